"""Limits at the HTTP layer: no request may hold the server, or a connection, without bound.

    BodyLimit (ASGI middleware)   the request's head, checked before its body is read:
                                  at most `max_header_bytes` of request line and headers
                                  (431), and no Content-Length beside a Transfer-Encoding
                                  (400: a proxy in front may frame the body by the other
                                  header, and read a second, smuggled request from it);
                                  then the body, read in full before any route runs: at
                                  most `max_body_bytes` (413; a Content-Length over it is
                                  refused before one byte is read), each chunk within
                                  `body_timeout_s` of the last, and all of it within
                                  `body_deadline_s` (408: neither a client that promised
                                  more bytes than it sends nor one that trickles a byte at
                                  a time holds a connection). Each refusal closes the
                                  connection: the rest of what the client sent is unread.
    header_timeout_protocol()     uvicorn's h11 protocol, plus a deadline for the request
                                  line and headers of each request on a connection, and
                                  the same 431 when h11 finds a head too long while it
                                  still arrives
    HostCheck (ASGI middleware)   the Host header must name this server (400 otherwise):
                                  without it a page on any site could reach a loopback
                                  server through DNS rebinding (its name re-pointed at
                                  127.0.0.1), and a server without a key would answer

Imports nothing heavy at module level: `tokenmill serve --help` reads ServerLimits'
defaults, and the CLI's start-up should not pay for uvicorn.

Reading the whole body first is what every JSON route does anyway; doing it here bounds it
once, for every route, before FastAPI parses anything. The app then gets the body from
memory, and its later `receive()` calls reach the real connection, so disconnect
detection works as before.

The default body limit follows the context length: `default_max_body_bytes` allows 64
bytes per context token (a token is a few bytes of text, up to ~12 once JSON escapes a
non-ASCII character), and never less than 1 MiB.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.server.asgi import HTTPMiddleware, replay_body

if TYPE_CHECKING:
    import asyncio

    from starlette.types import ASGIApp, Receive, Scope, Send

    from tokenmill.server.metrics import HTTPRequests

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64
CLOSE = {"Connection": "close"}  # a refusal leaves the rest of the request unread


def default_max_body_bytes(max_model_len: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int | None = None  # None: default_max_body_bytes(the engine's context)
    body_timeout_s: float = 30.0  # the longest wait for the next chunk of a request body
    body_deadline_s: float = 60.0  # a whole request body, from the end of its headers
    max_header_bytes: int = 16 << 10  # the request line and headers (h11's default)
    header_timeout_s: float = 10.0  # request line + headers, from connection or last response
    keep_alive_s: float = 5.0  # an idle connection between requests (uvicorn's default)
    shutdown_timeout_s: float = 30.0  # on SIGTERM, how long running requests may finish
    # the host names (or addresses) a request's Host header may give; None: any
    allowed_hosts: tuple[str, ...] | None = None


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> None:
    """A JSON error in the shape of the API whose route the request's path is (OpenAI's,
    or Anthropic's under /v1/messages: server/errors.py's FORMATTERS), sent straight
    through ASGI (ASCII-escaped: it may quote a client's text)."""
    from tokenmill.server.errors import APIError  # here: see the module's docstring

    error = APIError(status, message, code=code)
    body = json.dumps(error.body(scope.get("path", ""))).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit(HTTPMiddleware):
    """Read each HTTP request's body in full, within size and time limits."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        timeout_s: float,
        deadline_s: float = ServerLimits.body_deadline_s,
        max_header_bytes: int = ServerLimits.max_header_bytes,
    ):
        super().__init__(app)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.max_header_bytes = max_header_bytes

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        import asyncio  # here, not at the top: see the module's docstring

        if await self._bad_head(scope, send):
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, send, declared)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.timeout_s, left)))
            except TimeoutError:
                of = declared if declared is not None else "unknown"
                if left < self.timeout_s:
                    message = (
                        f"the request body took too long: {size} of {of} bytes in "
                        f"{self.deadline_s:g} s, the most a body may take (--body-deadline)"
                    )
                else:
                    message = (
                        f"the request body did not arrive: no bytes for {self.timeout_s:g} s "
                        f"after {size} of {of} (--body-timeout)"
                    )
                await send_error(scope, send, 408, message, "request_timeout", CLOSE)
                return
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send, size)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        # request.state.body_bytes: the app picks a worker lane by it
        scope.setdefault("state", {})["body_bytes"] = size
        await self.app(scope, replay_body(b"".join(chunks), receive), send)

    async def _bad_head(self, scope: Scope, send: Send) -> bool:
        """Refuse a request whose head is too long or frames its body twice; True when
        refused."""
        size = head_bytes(scope)
        if size > self.max_header_bytes:
            await send_error(
                scope,
                send,
                431,
                f"the request line and headers have {size} bytes; this server takes at "
                f"most {self.max_header_bytes} (serve --max-header-bytes)",
                "request_header_fields_too_large",
                CLOSE,
            )
            return True
        names = {name for name, _ in scope["headers"]}
        if b"content-length" in names and b"transfer-encoding" in names:
            await send_error(
                scope,
                send,
                400,
                "the request has both Content-Length and Transfer-Encoding; send one: "
                "each frames the body differently",
                "ambiguous_body_length",
                CLOSE,
            )
            return True
        return False

    async def _too_large(self, scope: Scope, send: Send, size: int) -> None:
        await send_error(
            scope,
            send,
            413,
            f"the request body has {'at least ' if size else ''}{size} bytes; this server "
            f"takes at most {self.max_bytes} (--max-body-bytes)",
            "request_too_large",
            CLOSE,
        )


def head_bytes(scope: Scope) -> int:
    """The size of a request's line and headers, in the form clients send them:
    "METHOD TARGET HTTP/1.1\\r\\n", "name: value\\r\\n" for each header, "\\r\\n"."""
    target = len(scope["raw_path"]) + (
        len(scope["query_string"]) + 1 if scope["query_string"] else 0
    )
    line = len(scope["method"]) + 1 + target + len(" HTTP/") + len(scope["http_version"]) + 2
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed length before we see it
    return None


def host_name(host: str) -> str:
    """The name part of a Host header value or an --allowed-hosts entry, compared
    case-insensitively: "LocalHost:8000" -> "localhost", "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, maybe with a port after its "]"
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")  # "localhost." is the same name, fully qualified


class HostCheck(HTTPMiddleware):
    """Answer only requests whose Host header names an allowed host.

    A browser sends the name it looked up, so a rebinding page's requests carry its own
    name ("attacker.example") and are refused here, while the web page served at
    http://127.0.0.1:PORT/ or http://localhost:PORT/ keeps working. A request without a
    Host header (HTTP/1.0) comes from no browser and passes."""

    def __init__(self, app: ASGIApp, *, allowed: Collection[str]):
        super().__init__(app)
        self.allowed = frozenset(host_name(h) for h in allowed)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        if host is not None:
            name = host_name(host.decode("latin-1"))
            if name not in self.allowed:
                shown = name if len(name) <= 100 else name[:97] + "..."
                await send_error(
                    scope,
                    send,
                    400,
                    f"this server does not answer to the host {shown!r} (the request's "
                    "Host header); its operator can add it with --allowed-hosts",
                    "invalid_host",
                )
                return
        await self.app(scope, receive, send)


def header_timeout_protocol(
    header_timeout_s: float, max_header_bytes: int, requests: HTTPRequests | None = None
) -> type:
    """uvicorn's h11 protocol class with a deadline for each request's line and headers
    (pass it to uvicorn as `http=`, with `h11_max_incomplete_event_size=max_header_bytes`;
    uvicorn builds the protocol objects itself).

    Their size is checked twice: h11 refuses a head that grows past the limit while it
    still arrives (uvicorn answers that with a plain 400; here it is BodyLimit's 431), and
    BodyLimit one that came whole in a single read, which h11 never measures. The answers
    given here, before any middleware, are counted in `requests` (/metrics) too.

    uvicorn closes an idle keep-alive connection (timeout_keep_alive) but not one that has
    sent part of a request line or header and stalls: that one would hold its connection
    forever. The deadline runs from the connection's start, or from the first byte of each
    later request, to the end of that request's headers (the body has its own timeout, in
    BodyLimit)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from tokenmill.server.errors import APIError  # here: see the module's docstring

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            between_requests = cycle is None or cycle.response_complete
            super().data_received(data)
            if self.cycle is not cycle:  # this data completed a new request's headers
                self._disarm_header_deadline()
            elif between_requests and self._header_deadline is None:
                self._arm_header_deadline()  # the first bytes of the next request

        def on_response_complete(self) -> None:
            self._disarm_header_deadline()  # idle from here: timeout_keep_alive applies
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            self._disarm_header_deadline()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def send_400_response(self, msg: str) -> None:
            waiting = len(self.conn.trailing_data[0])
            too_large = waiting > max_header_bytes
            if requests is not None:
                requests.by_code[431 if too_large else 400] += 1
            if not too_large:
                super().send_400_response(msg)
                return
            # h11 gave up on a head still incomplete past the limit: no route is known yet
            error = APIError(
                431,
                f"the request line and headers have more than {max_header_bytes} bytes; "
                f"this server takes at most {max_header_bytes} (serve --max-header-bytes)",
                code="request_header_fields_too_large",
            )
            body = json.dumps(error.body()).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            for event in (
                h11.Response(status_code=431, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _headers_late(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol

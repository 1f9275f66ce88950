"""The base of tokenmill's ASGI middlewares (limits.py's BodyLimit and HostCheck,
metrics.py's CountRequests, model_pool.py's ModelSelect), and the replay of a body read
in full. A leaf: it imports nothing of tokenmill, so any server
module can build on it without an import loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HTTPMiddleware:
    """A pure ASGI middleware that acts on HTTP requests alone: other scopes (lifespan,
    websocket) go to the app untouched, and `http` says what a subclass does with a
    request. Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would run every
    streamed response through a task and a memory stream of its own."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A receive channel that gives `body` (read in full before) once, then the real
    connection's messages (an http.disconnect, when the client goes)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the tests of models by name
(tokenmill/hf.py): the real Hub is not reachable from these machines, so this serves the
routes huggingface_hub calls, for a few real files, over real HTTP (HF_ENDPOINT):

    GET  /api/models/ORG/REPO[/revision/REV]   the model info: commit and siblings, with
                                               each large file's SHA-256 (its LFS info)
    HEAD /ORG/REPO/resolve/REV/FILE            the file's commit, ETag and size
    GET  /ORG/REPO/resolve/REV/FILE            its bytes, a Range of them with 206

It can also break as networks and hubs break: cut a file's first download short
(`cut_once`), or list a wrong SHA-256 for a file (`wrong_sha`). Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".gguf", ".safetensors")


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path | bytes]]):
        self.repos = {
            repo: {
                name: (c.read_bytes() if isinstance(c, Path) else c) for name, c in files.items()
            }
            for repo, files in repos.items()
        }
        self.cut_once: dict[str, int] = {}  # file name -> bytes its first GET sends, then closes
        self.wrong_sha: set[str] = set()  # file names listed with a wrong SHA-256
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self._lock = threading.Lock()

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def sha256(self, name: str, data: bytes) -> str:
        if name in self.wrong_sha:
            return hashlib.sha256(data + b"!").hexdigest()
        return hashlib.sha256(data).hexdigest()

    def info(self, repo: str) -> dict:
        siblings = []
        for name, data in sorted(self.repos[repo].items()):
            sibling = {"rfilename": name, "size": len(data)}
            if name.endswith(LFS_SUFFIXES):
                sibling["lfs"] = {
                    "sha256": self.sha256(name, data), "size": len(data), "pointerSize": 134,
                }  # fmt: skip
            siblings.append(sibling)
        return {
            "_id": self.commit(repo)[:24], "id": repo, "modelId": repo, "sha": self.commit(repo),
            "private": False, "disabled": False, "gated": False, "downloads": 0, "likes": 0,
            "tags": [], "siblings": siblings,
        }  # fmt: skip


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _record(self) -> None:
            with hub._lock:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))

        def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, what: str) -> None:
            body = json.dumps({"error": f"{what} not found"}).encode()
            self._send(404, body, {"X-Error-Code": "RepoNotFound", "X-Error-Message": what})

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._record()
            path = unquote(urlparse(self.path).path)
            if path.startswith("/api/models/"):
                parts = path[len("/api/models/") :].split("/")
                repo = "/".join(parts[:2])
                if repo not in hub.repos:
                    return self._not_found(repo)
                body = json.dumps(hub.info(repo)).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            self._file()

        def do_HEAD(self) -> None:  # noqa: N802
            self._record()
            self._file()

        def _file(self) -> None:
            path = unquote(urlparse(self.path).path).lstrip("/")
            parts = path.split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._not_found(path)
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            data = hub.repos.get(repo, {}).get(name)
            if data is None:
                return self._not_found(f"{repo}/{name}")
            headers = {
                "X-Repo-Commit": hub.commit(repo),
                "ETag": f'"{hub.sha256(name, data)}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes=") and self.command == "GET":
                start = int(wanted[6:].split("-")[0])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            cut = hub.cut_once.pop(name, None) if self.command == "GET" else None
            if cut is None:
                return self._send(status, body, headers)
            # the connection drops after `cut` bytes of a response that promised them all
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True

    return Handler


@contextmanager
def serving(hub: FakeHub) -> Iterator[str]:
    """The hub on a free loopback port; yields its URL (for HF_ENDPOINT)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()

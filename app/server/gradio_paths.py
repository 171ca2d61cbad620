"""The UI's server paths hidden, and its uploads held to each owner's quota: ASGI middleware before Gradio's routes.

Gradio names a file by its absolute path on the server: its upload route answers with the paths it stored the files
at, and its outputs and page carry them (a result's `path`, and its URL /gradio_api/file=<path>). ServerPaths
rewrites every answer's upload folder and results folder to an alias (UPLOADS_ALIAS, RESULTS_ALIAS) and every
request's alias back, in request bodies and file URLs, so that Gradio itself sees the paths it made and no answer
names a folder of the server's. Rewritten: the answers in JSON, server-sent events (by whole events) and HTML (the
page embeds its config); the requests in JSON and the file routes' paths. Files themselves pass untouched.

The same middleware holds Gradio's upload route (POST /gradio_api/upload) to --max-upload-mb-per-owner: the bytes a
login (or, without logins, a client address: an upload carries no other identity) has uploaded that are still in
the folder, plus the new request's, may not pass it: 429 with a message, before Gradio reads the body. Uploads no
request uses go within a minute (app.server.uploads), so what is held is what is in use or just sent.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse

UPLOADS_ALIAS = "~uploads/"
"""What an answer says in place of the upload folder (and a request's path to an upload starts with)."""
RESULTS_ALIAS = "~results/"
"""What an answer says in place of the results folder."""
REWRITTEN_TYPES = ("application/json", "text/event-stream", "text/html")
"""Content types whose answers are rewritten (their bodies are text)."""
FILE_ROUTE = "/file="

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ServerPaths:
    """ASGI middleware (see the module docstring): `uploads` and `results` are the folders hidden behind the aliases;
    `upload_quota` the bytes one uploader may hold in the upload folder (None: no limit)."""

    def __init__(self, app: Any, *, uploads: Path, results: Path, upload_quota: int | None = None) -> None:
        self.app = app
        uploads, results = Path(uploads).resolve(), Path(results).resolve()
        self._folders = {UPLOADS_ALIAS: f"{uploads}/", RESULTS_ALIAS: f"{results}/"}
        self._out = [(folder.encode(), alias.encode()) for alias, folder in self._folders.items()]
        self._in = [(f'"{alias}'.encode(), f'"{folder}'.encode()) for alias, folder in self._folders.items()]
        self.upload_quota = upload_quota
        self._held: dict[str, dict[str, int]] = {}
        """Uploader -> its uploads' paths and sizes (pruned of files no longer there as it is read)."""
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if FILE_ROUTE in path:  # a file: its path in, the file out as it is
            head, _, name = path.partition(FILE_ROUTE)
            for alias, folder in self._folders.items():
                if name.startswith(alias):
                    name = folder + name[len(alias):]
                    scope = {**scope, "path": f"{head}{FILE_ROUTE}{name}",
                             "raw_path": f"{head}{FILE_ROUTE}{quote(name)}".encode()}
                    break
            await self.app(scope, receive, send)
            return
        uploader = None
        if scope["method"] == "POST" and path.rstrip("/").endswith("/upload"):
            uploader = _uploader(scope)
            refusal = self._over_quota(uploader, _content_length(scope))
            if refusal:
                await PlainTextResponse(refusal, status_code=429, headers={"Retry-After": "60"})(scope, receive, send)
                return
        if _header(scope, b"content-type").startswith(b"application/json"):
            receive = await self._rewritten_request(receive)
        await self.app(scope, receive, self._rewriting(send, uploader))

    def _over_quota(self, uploader: str, incoming: int) -> str | None:
        """Why `uploader` may not upload `incoming` more bytes (None: it may)."""
        if self.upload_quota is None:
            return None
        held = self.held(uploader)
        if held + incoming <= self.upload_quota:
            return None
        return (f"too much uploaded: {held / 1e6:.1f} MB of your uploads are on the server and this one brings "
                f"{incoming / 1e6:.1f} MB; the most for one client is {self.upload_quota / 1e6:g} MB "
                f"(--max-upload-mb-per-owner). Uploads no request uses are deleted within a minute: try again then")

    def held(self, uploader: str) -> int:
        """Bytes of `uploader`'s uploads still in the upload folder."""
        with self._lock:
            files = self._held.get(uploader, {})
            for path in [path for path in files if not Path(path).is_file()]:
                del files[path]
            if not files:
                self._held.pop(uploader, None)
            return sum(files.values())

    def _record(self, uploader: str, body: bytes) -> None:
        """The upload route's answer (a JSON list of the stored files' paths): count them as `uploader`'s."""
        try:
            paths = json.loads(body)
        except ValueError:
            return
        if not isinstance(paths, list):
            return
        with self._lock:
            files = self._held.setdefault(uploader, {})
            for path in paths:
                if isinstance(path, str):
                    try:
                        files[path] = Path(path).stat().st_size
                    except OSError:
                        pass

    async def _rewritten_request(self, receive: Receive) -> Receive:
        """The request's whole body with the aliases back to the folders, as one message."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replaying({"type": "http.disconnect"}, receive)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        for alias, folder in self._in:
            body = body.replace(alias, folder)
        return _replaying({"type": "http.request", "body": body, "more_body": False}, receive)

    def _rewriting(self, send: Send, uploader: str | None) -> Send:
        """`send` with the answer's folders turned into their aliases (bodies of REWRITTEN_TYPES alone)."""
        state: dict[str, Any] = {"start": None, "mode": None, "buffer": b""}

        async def rewritten(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"").decode("latin-1")
                kind = next((kind for kind in REWRITTEN_TYPES if content_type.startswith(kind)), None)
                if kind is None and uploader is None:
                    await send(message)
                    state["mode"] = "pass"
                    return
                state["mode"], state["start"] = kind or "pass-recorded", message
                if kind == "text/event-stream":
                    await send(message)  # events go out as they come; their length was never fixed
                return
            if message["type"] != "http.response.body" or state["mode"] == "pass":
                await send(message)
                return
            state["buffer"] += message.get("body", b"")
            more = message.get("more_body", False)
            if state["mode"] == "text/event-stream":  # whole events only, so that no path is cut in two
                end = state["buffer"].rfind(b"\n\n")
                cut = (end + 2 if end >= 0 else 0) if more else len(state["buffer"])
                ready, state["buffer"] = state["buffer"][:cut], state["buffer"][cut:]
                if ready or not more:
                    await send({"type": "http.response.body", "body": self._hide(ready), "more_body": more})
                return
            if more:
                return
            body = state["buffer"]
            if uploader is not None and state["start"]["status"] == 200:
                self._record(uploader, body)
            if state["mode"] != "pass-recorded":
                body = self._hide(body)
            start = state["start"]
            headers = [(key, value) for key, value in start.get("headers", []) if key.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        return rewritten

    def _hide(self, body: bytes) -> bytes:
        for folder, alias in self._out:
            body = body.replace(folder, alias)
        return body


def _replaying(first: dict[str, Any], receive: Receive) -> Receive:
    """A receive that gives `first`, then whatever `receive` gives (a disconnect, later)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return replay


def _header(scope: Scope, name: bytes) -> bytes:
    return next((value for key, value in scope.get("headers", []) if key.lower() == name), b"")


def _content_length(scope: Scope) -> int:
    try:
        return max(0, int(_header(scope, b"content-length") or 0))
    except ValueError:
        return 0


def login_of(scope: Scope) -> str | None:
    """The login a request to Gradio's app comes from (the user its access-token cookie names), or None: no login,
    or a UI without logins."""
    gradio_app = scope.get("app")
    if not getattr(gradio_app, "auth", None):
        return None
    cookies = StarletteRequest(scope).cookies
    token = (cookies.get(f"access-token-{gradio_app.cookie_id}")
             or cookies.get(f"access-token-unsecure-{gradio_app.cookie_id}"))
    return gradio_app.tokens.get(token) if token else None


def _uploader(scope: Scope) -> str:
    """Whose an upload is: its login (login_of), else the client's address."""
    user = login_of(scope)
    if user:
        return f"user:{user}"
    client = scope.get("client") or ("", 0)
    return f"address:{client[0]}"

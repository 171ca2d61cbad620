"""Request ids and the server's log: every HTTP request carries an X-Request-Id, and the log says which.

RequestIds (ASGI middleware, outermost on both servers) takes the client's `X-Request-Id` when it is a plain token
(1-128 letters, digits and `-_.:`), or makes one (`req_` and 32 hex digits); the response echoes it, and while the
request is answered `current_request_id()` gives it: log records take it from there (RequestIdFilter), and so do the
tasks a request starts (asyncio copies the context), such as a video job's follower. One line is logged per request
to the API (`/v1/...`) and to GET /status: method, path, status, seconds, request id. Probes (/health, /ready,
/metrics) and the web page's own traffic are not logged.

`--log-format json` writes each record as one JSON object a line (time, level, logger, message, request_id and the
record's fields); `text` (the default) as one line of words. Both go to stderr, beside the server's other lines.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

from app.server.access import Receive, Scope, Send

HEADER = "x-request-id"
LOGGER = "ulysses_studio"
LOG_FORMATS = ("text", "json")
_GIVEN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""An X-Request-Id taken as given; anything else (too long, spaces, control characters) is replaced."""
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_FIELDS = ("method", "path", "status", "seconds", "video_id", "event", "attempt")
"""The record attributes (logging's `extra`) that a JSON line carries besides the message."""

log = logging.getLogger(LOGGER)


def current_request_id() -> str | None:
    """The id of the request being answered (in its task, and in the tasks it started); None elsewhere."""
    return _REQUEST_ID.get()


def request_id_of(given: str | None) -> str:
    """The client's id when it is a plain token, else a new one."""
    if given is not None and _GIVEN.fullmatch(given):
        return given
    return f"req_{uuid.uuid4().hex}"


def _logged(path: str) -> bool:
    return path.startswith("/v1/") or path == "/status"


class RequestIds:
    """ASGI middleware: an id for every HTTP request (the client's or a new one), echoed in X-Request-Id, set as the
    current request id while it is answered, and one log line per API request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the raw headers, not starlette's Headers: every command imports this module (its log format), and the
        # generate and batch commands run where starlette is not installed
        given = next((value.decode("latin-1") for name, value in scope["headers"] if name.lower() == b"x-request-id"),
                     None)
        request_id = request_id_of(given)
        token = _REQUEST_ID.set(request_id)
        started = time.monotonic()
        status: list[int] = []

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                headers = [(name, value) for name, value in message.get("headers", [])
                           if name.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (HEADER.encode(), request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            if _logged(scope["path"]):
                seconds = round(time.monotonic() - started, 3)
                code = status[0] if status else 0
                log.info("%s %s %s %.3f s", scope["method"], scope["path"], code, seconds,
                         extra={"method": scope["method"], "path": scope["path"], "status": code, "seconds": seconds})
            _REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` (the current request's, or None)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id()
        return True


class TextFormatter(logging.Formatter):
    """A record as one line: time, level, [request id or -], message."""

    def format(self, record: logging.LogRecord) -> str:
        line = (f"{self.formatTime(record)} {record.levelname} [{getattr(record, 'request_id', None) or '-'}] "
                f"{record.getMessage()}")
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: time (epoch seconds), level, logger, message, request_id, and its fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage(), "request_id": getattr(record, "request_id", None)}
        line.update({name: getattr(record, name) for name in _FIELDS if hasattr(record, name)})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(log_format: str) -> None:
    """Send the server's log (the `ulysses_studio` logger) to stderr, as words or JSON lines (--log-format)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format takes {' or '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False

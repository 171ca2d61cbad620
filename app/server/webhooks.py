"""Webhooks in OpenAI's shape: `video.completed` and `video.failed` events posted to one URL (--webhook-url),
signed the Standard Webhooks way OpenAI signs them, so that `openai.OpenAI(webhook_secret=...).webhooks.unwrap`
verifies them.

An event is {"id": "evt_...", "object": "event", "created_at": SECONDS, "type": "video.completed", "data": {"id":
"video_..."}}, posted as JSON with

    webhook-id         the event's id (the same on every attempt: a receiver drops repeats by it)
    webhook-timestamp  the attempt's time, whole seconds since the epoch
    webhook-signature  "v1," + base64(HMAC-SHA256(secret, "{webhook-id}.{webhook-timestamp}.{body}")), the secret
                       being the base64 after `whsec_` in --webhook-secret-file

A delivery that fails (no connection, a timeout, a status other than 2xx) is tried again after 1 s, 2 s, 4 s, ...
(ATTEMPTS tries in all), then given up with a line in the log. Deliveries run on a thread of their own: sending
an event only queues it, so neither the job queue nor a client's request ever waits for a receiver. Events not yet
delivered when the server ends are dropped.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from app.server.request_ids import LOGGER

ATTEMPTS = 6
"""Tries of one event: the first, then after 1, 2, 4, 8 and 16 s."""
FIRST_RETRY_SECONDS = 1.0
TIMEOUT_SECONDS = 10.0
"""How long one attempt may take (connection and answer)."""
CLOSE_SECONDS = 1.0
"""How long closing waits for an attempt under way (the thread is a daemon: the server's end never waits longer)."""
SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES = 24
"""Shortest secret taken (Standard Webhooks: 24 to 64 bytes)."""

log = logging.getLogger(f"{LOGGER}.webhooks")


class WebhookError(ValueError):
    """A webhook option that cannot be used; the message says which and why (never the secret)."""


def read_webhook_secret(path: str | Path) -> str:
    """The secret of --webhook-secret-file: one line `whsec_` + base64 of 24 bytes or more (OpenAI's form)."""
    path = Path(path)
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise WebhookError(f"cannot read --webhook-secret-file {path}: {error.strerror or error}") from None
    secret = lines[0] if len(lines) == 1 else ""
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except ValueError:  # binascii.Error is one
        key = b""
    if not secret.startswith(SECRET_PREFIX) or len(key) < MIN_SECRET_BYTES:
        raise WebhookError(f"--webhook-secret-file {path} must hold one line: {SECRET_PREFIX} and the base64 of "
                           f"{MIN_SECRET_BYTES} or more random bytes (e.g. python -c \"import base64, os; "
                           f"print('{SECRET_PREFIX}' + base64.b64encode(os.urandom(32)).decode())\")")
    return secret


def check_webhook_url(url: str) -> None:
    """WebhookError unless `url` is one to post events to."""
    if not url.startswith(("http://", "https://")):
        raise WebhookError(f"--webhook-url must be an http:// or https:// URL, got {url!r}")


def signature(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header of `body` (Standard Webhooks v1)."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


@dataclass(frozen=True)
class _Delivery:
    event_id: str
    body: bytes
    attempt: int
    """Tries made before this one."""
    request_id: str | None
    """The id of the request that made the event (for the log)."""


class Webhooks:
    """Posts events to `url`, signed with `secret`, from a thread of its own (start it with start())."""

    def __init__(self, url: str, secret: str, *, attempts: int = ATTEMPTS,
                 first_retry_seconds: float = FIRST_RETRY_SECONDS) -> None:
        check_webhook_url(url)
        self.url = url
        self._secret = secret
        self._attempts = attempts
        self._first_retry = first_retry_seconds
        self._due: list[tuple[float, int, _Delivery]] = []
        """(when, order, delivery): a heap, the next due first."""
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._deliver_all, name="webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, event_type: str, data: dict, request_id: str | None = None) -> str:
        """Queue one event (`data`: its object, e.g. {"id": "video_..."}) and return its id; never waits."""
        event_id = f"evt_{uuid.uuid4().hex}"
        body = json.dumps({"id": event_id, "object": "event", "created_at": int(time.time()), "type": event_type,
                           "data": data}).encode()
        self._queue(_Delivery(event_id, body, 0, request_id), time.monotonic())
        return event_id

    def close(self) -> None:
        """Stop delivering (events still queued are dropped)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_SECONDS)

    def _queue(self, delivery: _Delivery, when: float) -> None:
        with self._changed:
            heapq.heappush(self._due, (when, next(self._order), delivery))
            self._changed.notify_all()

    def _next(self) -> _Delivery | None:
        """The next delivery once it is due; None once closed."""
        with self._changed:
            while not self._closed:
                wait = self._due[0][0] - time.monotonic() if self._due else None
                if wait is not None and wait <= 0:
                    return heapq.heappop(self._due)[2]
                self._changed.wait(wait)
            return None

    def _deliver_all(self) -> None:
        while (delivery := self._next()) is not None:
            problem = self._post(delivery)
            extra = {"request_id": delivery.request_id, "event": delivery.event_id, "attempt": delivery.attempt + 1}
            if problem is None:
                log.info("webhook %s delivered to %s", delivery.event_id, self.url, extra=extra)
            elif delivery.attempt + 1 < self._attempts:
                delay = self._first_retry * 2 ** delivery.attempt
                log.warning("webhook %s to %s failed (%s); trying again in %g s", delivery.event_id, self.url,
                            problem, delay, extra=extra)
                self._queue(replace(delivery, attempt=delivery.attempt + 1), time.monotonic() + delay)
            else:
                log.error("webhook %s to %s failed (%s); given up after %d tries", delivery.event_id, self.url,
                          problem, self._attempts, extra=extra)

    def _post(self, delivery: _Delivery) -> str | None:
        """One attempt; None when the receiver took it (2xx), else what went wrong."""
        timestamp = int(time.time())
        headers = {"content-type": "application/json", "user-agent": "ulysses-studio-webhooks",
                   "webhook-id": delivery.event_id, "webhook-timestamp": str(timestamp),
                   "webhook-signature": signature(self._secret, delivery.event_id, timestamp, delivery.body)}
        request = urllib.request.Request(self.url, data=delivery.body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                status = response.status
        except urllib.error.HTTPError as error:
            status = error.code
        except (OSError, ValueError) as error:  # no connection, a timeout, a bad answer
            return f"{type(error).__name__}: {error}"
        return None if 200 <= status < 300 else f"status {status}"

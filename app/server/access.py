"""Who may use a server: its logins, and a throttle on failed login attempts.

Logins come from a file (`--auth-file`, lines `user:password`), from $ULYSSES_STUDIO_AUTH
(`user:password`), or from `--auth user:password`, which still works but puts the password in the
process list, readable by every local user: the launcher then moves it into a private file before
any rank starts. Only rank 0 reads logins; the other ranks never see them.

Gradio checks passwords at POST /login and has no limit on tries. LoginThrottle sits in front of it
(an ASGI middleware): per client address, after FREE_FAILURES failed logins every attempt is refused
with 429 for a lockout that doubles with each further failure (1 s, 2 s, 4 s, ... up to MAX_LOCKOUT
seconds), a correct password included; a success clears the address's count. The OpenAI-compatible
API's bearer keys (`--api-key-file`, one a line, read by rank 0 alone as logins are) count in the same
LoginFailures: a wrong key is a failed login of its address, and a locked-out address is refused either way.

The address is the one uvicorn puts in the request's scope["client"]: it rewrites that from the
X-Forwarded-For header, before any middleware runs, for the peers it trusts, by default 127.0.0.1 and
::1 (or $FORWARDED_ALLOW_IPS). Gradio starts uvicorn without a say in this, so any local client could
give every login a new made-up address and never be throttled. The server therefore sets
$FORWARDED_ALLOW_IPS itself (trust_forwarded_headers) to exactly the `--trusted-proxy` addresses,
none by default: a login counts against its peer, unless that peer is a trusted proxy, in which case
against the rightmost address of its X-Forwarded-For that is not a trusted proxy (the client the
proxies saw; the addresses left of it are the client's own to make up).
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

AUTH_ENV = "ULYSSES_STUDIO_AUTH"
FREE_FAILURES = 5
FIRST_LOCKOUT = 1.0
MAX_LOCKOUT = 60.0
MIN_API_KEY_CHARS = 16
"""Shortest API key accepted: a guessable key would make the throttle the only defence."""
FORGET_AFTER = 900.0
"""Seconds after its last failure that an address's count is forgotten."""
MAX_TRACKED = 10_000
"""Addresses tracked at once (the least recent are dropped beyond it)."""
FORWARDED_ALLOW_IPS = "FORWARDED_ALLOW_IPS"
"""uvicorn's variable: the peers whose X-Forwarded-For it believes, comma-separated ("": none)."""


class AuthError(ValueError):
    """Logins that cannot be read; the message says where and why (never a password)."""


def parse_login(text: str, where: str) -> tuple[str, str]:
    user, colon, password = text.strip().partition(":")
    if not (user and colon and password):
        raise AuthError(f"{where} must look like USER:PASSWORD")
    return user, password


def _entries(path: Path, option: str) -> list[tuple[int, str]]:
    """The numbered lines of the file of `option` (e.g. --auth-file), blank lines and lines starting with # skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise AuthError(f"cannot read {option} {path}: {error.strerror or error}") from None
    return [(number, line) for number, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")]


def read_auth_file(path: str | Path) -> list[tuple[str, str]]:
    """The logins of a file: one `user:password` a line; blank lines and lines starting with # are skipped."""
    path = Path(path)
    logins = [parse_login(line, f"line {number} of --auth-file {path}")
              for number, line in _entries(path, "--auth-file")]
    if not logins:
        raise AuthError(f"--auth-file {path} has no USER:PASSWORD line")
    return logins


def read_api_keys(path: str | Path) -> tuple[list[str], list[str]]:
    """The API keys of `--api-key-file` and those of them marked admin: one key a line, `KEY` or `KEY admin` (an
    admin key sees every owner's jobs); blank lines and lines starting with # are skipped."""
    path = Path(path)
    keys, admins = [], []
    for number, line in _entries(path, "--api-key-file"):
        key, *marks = line.split()
        if len(key) < MIN_API_KEY_CHARS or marks not in ([], ["admin"]):
            raise AuthError(f"line {number} of --api-key-file {path}: a key is at least {MIN_API_KEY_CHARS} "
                            "characters without spaces, alone on its line or followed by the word admin")
        keys.append(key)
        if marks:
            admins.append(key)
    if not keys:
        raise AuthError(f"--api-key-file {path} has no key")
    return keys, admins


def read_logins(auth: str | None, auth_file: str | None, environ: dict[str, str] | None = None, *,
                warn: bool = True) -> list[tuple[str, str]] | None:
    """The server's logins from the one source given (None: no login asked); AuthError if several are.
    `warn`: say on stderr that --auth shows the password (once per command line, where it is checked)."""
    environ = os.environ if environ is None else environ
    sources = (("--auth", auth), ("--auth-file", auth_file), (f"${AUTH_ENV}", environ.get(AUTH_ENV)))
    given = [name for name, value in sources if value]
    if len(given) > 1:
        raise AuthError(f"give the login one way: {' and '.join(given)} are both set")
    if auth_file:
        return read_auth_file(auth_file)
    if environ.get(AUTH_ENV):
        return [parse_login(environ[AUTH_ENV], f"${AUTH_ENV}")]
    if auth:
        login = parse_login(auth, "--auth")
        if warn:
            print(f"warning: --auth shows the password to every user of this machine (in the process list); "
                  f"use --auth-file FILE or ${AUTH_ENV} instead", file=sys.stderr, flush=True)
        return [login]
    return None


def write_private_auth_file(logins: list[tuple[str, str]], path: Path) -> Path:
    """Write `logins` to a new file that only this user may read (the launcher's hand-over to rank 0)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.writelines(f"{user}:{password}\n" for user, password in logins)
    return path


def parse_trusted_proxies(values: list[str] | None) -> list[str]:
    """The addresses and networks of `--trusted-proxy` (repeated, or comma-separated), written as uvicorn
    reads them; AuthError for anything else, as uvicorn would silently compare it as text instead."""
    proxies = []
    for value in (part.strip() for given in values or [] for part in given.split(",") if part.strip()):
        try:
            network = "/" in value
            proxies.append(str(ipaddress.ip_network(value, strict=False) if network else ipaddress.ip_address(value)))
        except ValueError:
            raise AuthError(f"--trusted-proxy {value!r} is not an IP address or network (e.g. 10.0.0.5 or "
                            "10.0.0.0/24): name the proxies in front of this server, not their host names") from None
    return proxies


def trust_forwarded_headers(proxies: list[str], environ: MutableMapping[str, str]) -> None:
    """Have uvicorn take a request's client from X-Forwarded-For only where its peer is one of `proxies`
    (none: never), replacing its default and any inherited $FORWARDED_ALLOW_IPS. Set before uvicorn starts."""
    environ[FORWARDED_ALLOW_IPS] = ",".join(proxies)


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class LoginFailures:
    """Failed logins per client address, and the lockout they earn (see the module docstring): shared by the
    UI's LoginThrottle and the API's key check (app.server.openai_api), so that both count against one limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failures: dict[str, tuple[int, float]] = {}
        """Address -> (failed logins, time of the last one)."""

    def lockout(self, address: str) -> float:
        """Seconds `address` must still wait before its next try (0: it may try now)."""
        failures, last = self._failures.get(address, (0, 0.0))
        if failures < FREE_FAILURES:
            return 0.0
        length = min(FIRST_LOCKOUT * 2 ** (failures - FREE_FAILURES), MAX_LOCKOUT)
        return max(0.0, last + length - self.clock())

    def failed(self, address: str) -> None:
        now = self.clock()
        failures, last = self._failures.pop(address, (0, now))
        if now - last > FORGET_AFTER:
            failures = 0
        self._failures[address] = (failures + 1, now)  # re-inserted: the dict stays ordered by last failure
        while len(self._failures) > MAX_TRACKED:
            del self._failures[next(iter(self._failures))]

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)


class LoginThrottle:
    """ASGI middleware that slows repeated failed logins per client address (see the module docstring: the
    address is scope["client"], so uvicorn must trust forwarded headers only from real proxies).

    failures: the counts to keep (a server shares them with its API's key check); a new set by default.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *,
                 failures: LoginFailures | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.failures = failures if failures is not None else LoginFailures(clock)
        self.lockout = self.failures.lockout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].rstrip("/").endswith("/login"):
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        wait = self.lockout(address)
        if wait > 0:
            await _refuse(send, wait)
            return
        status: list[int] = []

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, receive, watch)
        if status and status[0] == 200:
            self.failures.succeeded(address)
        elif status and 400 <= status[0] < 500:
            self.failures.failed(address)


async def _refuse(send: Send, wait: float) -> None:
    seconds = max(1, round(wait + 0.49))
    body = json.dumps({"detail": f"too many failed logins from this address: try again in {seconds} s"}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", str(seconds).encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

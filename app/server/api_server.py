"""`serve --no-ui`: the OpenAI-compatible API alone on rank 0, served by uvicorn and Starlette; Gradio is never
imported. And the routes both servers add to the API's: probes, status and metrics (server_routes).

The server is the UI's otherwise (app.server.serve: one queue, the groups, the limits, the keys, the results folder,
Ctrl-C and SIGTERM, a lost rank), for teams that put it behind their own tools. Besides the API's routes
(app.server.openai_api, under /v1), both servers answer

    GET /health   200 {"status": "ok"} while the ranks serve (warming up included); 503 {"status": "shutting_down"
                  or "lost", "message": ...} once the server stops or rank 0 sees a rank's process gone. No key
                  asked: it is for load balancers and probes, and tells nothing about the requests.
    GET /ready    200 {"status": "ready"} while the server takes requests; 503 {"status": "warming_up" or
                  "draining", "message": ...} before its start-up calibration has ended, and once it stops (or has
                  lost a rank). No key asked.
    GET /status   what the UI's status line says, as JSON: the server (models, ranks, plan, backend, the last
                  request's stage times) and the requests running and waiting; a key asked with --api-key-file.
    GET /metrics  Prometheus' text format (app.server.metrics); a key asked as for /status, unless --open-metrics.

and (without the UI) a 404 in the API's error shape at any other path, a 405 for a method a path does not take.
Every response carries an X-Request-Id (app.server.request_ids). Failed keys count in the same LoginFailures, behind the
same LoginThrottle, as in the UI's server; uvicorn believes X-Forwarded-For from the --trusted-proxy peers
alone, reading $FORWARDED_ALLOW_IPS (app.server.access.trust_forwarded_headers) as it does under Gradio.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from app.ranks.runtime import Runtime
from app.server.access import LoginThrottle
from app.server.jobs import JobQueue
from app.server.metrics import CONTENT_TYPE, ServerMetrics
from app.server.openai_api import ApiAccess, api_endpoint, api_routes, unmatched
from app.server.request_ids import RequestIds
from app.server.submit import Server, public_message, server_line
from app.server.webhooks import Webhooks

CLOSE_SECONDS = 5.0
"""How long closing waits for the requests still answering (their jobs have failed by then) before cutting them."""
START_SECONDS = 10.0
"""How long uvicorn may take to start serving on its thread."""

Health = Callable[[], tuple[str, "str | None"]]
"""("ok", None) while the ranks serve; else ("shutting_down" or "lost", why). Readiness alike: ("ready", None), or
("warming_up" or "draining", why)."""
WARMING_UP = "the server is warming up (measuring its time estimates); it takes requests in a moment"


@dataclass(frozen=True, kw_only=True)
class Probes:
    """What GET /health, /ready and /metrics read."""

    health: Health
    ready: Health
    metrics: ServerMetrics
    open_metrics: bool = False
    """/metrics without a key (--open-metrics)."""


def serving_health(runtime: Runtime, jobs: JobQueue, stop: threading.Event) -> Health:
    """The server's health as GET /health tells it: "lost" once rank 0 sees a rank's process gone (ranks of its
    own host), "shutting_down" once Ctrl-C or SIGTERM came or the queue closed, else "ok"."""

    def health() -> tuple[str, str | None]:
        dead = runtime.service.dead_ranks(wait=0.0)
        if dead:
            return "lost", f"the server lost rank {', '.join(map(str, dead))} and is ending"
        if stop.is_set() or jobs.closed is not None:
            return "shutting_down", jobs.closed or "the server is shutting down"
        return "ok", None

    return health


def serving_readiness(health: Health, warm: threading.Event) -> Health:
    """The server's readiness as GET /ready tells it: "draining" once `health` is not ok, "warming_up" until `warm`
    is set (the start-up calibration has ended), else "ready"."""

    def ready() -> tuple[str, str | None]:
        state, message = health()
        if state != "ok":
            return "draining", message
        if not warm.is_set():
            return "warming_up", WARMING_UP
        return "ready", None

    return ready


def server_status(runtime: Runtime, server: Server, health: str) -> dict[str, Any]:
    """GET /status: the server and its queue, as data (the UI's status line says the same in words)."""
    running, waiting = server.jobs.snapshot()
    names = {key: model.spec.name for key, model in runtime.models.items()}
    now = time.monotonic()
    return {
        "status": health,
        "server": server_line(runtime, server),
        "models": [{"id": model.spec.name, "media": model.spec.media} for model in runtime.models.values()],
        "ranks": runtime.world_size,
        "backend": runtime.backend,
        "running": [job.to_dict(names[job.model], now) for job in running],
        "waiting": [job.to_dict(names[job.model]) for job in waiting],
        "max_queue": server.jobs.max_waiting,
    }


def server_routes(runtime: Runtime, server: Server, access: ApiAccess, probes: Probes) -> list[BaseRoute]:
    """GET /health, /ready, /status and /metrics: the same on both servers (with the UI, beside Gradio's routes)."""

    def probe(check: Health, good: str) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            state, message = check()
            body = {"status": state} if message is None else {"status": state, "message": public_message(message)}
            return JSONResponse(body, status_code=200 if state == good else 503)

        return endpoint

    async def status_endpoint(request: Request) -> Response:
        return JSONResponse(server_status(runtime, server, probes.health()[0]))

    async def metrics_endpoint(request: Request) -> Response:
        return Response(probes.metrics.text(), media_type=CONTENT_TYPE)

    return [
        Route("/health", probe(probes.health, "ok"), methods=["GET"]),
        Route("/ready", probe(probes.ready, "ready"), methods=["GET"]),
        Route("/status", api_endpoint(status_endpoint, access), methods=["GET"]),
        Route("/metrics", api_endpoint(metrics_endpoint, None if probes.open_metrics else access), methods=["GET"]),
    ]


def server_middleware(access: ApiAccess) -> list[Middleware]:
    """Both servers' middleware, outermost first: request ids, then the failed-login throttle."""
    return [Middleware(RequestIds), Middleware(LoginThrottle, failures=access.failures)]


def api_app(runtime: Runtime, server: Server, access: ApiAccess, max_upload_bytes: int, probes: Probes,
            webhooks: Webhooks | None = None) -> Starlette:
    """The API-only app: the /v1 routes, the server's routes, and OpenAI's error shape at any other path."""
    routes = [*api_routes(runtime, server, access, max_upload_bytes, webhooks),
              *server_routes(runtime, server, access, probes)]
    return Starlette(routes=[*routes, unmatched("", routes)], middleware=server_middleware(access))


def display_url(host: str, port: int) -> str:
    """The URL to print for a server listening on `host:port` (everywhere: this machine's own name for it)."""
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"


class ApiServer:
    """uvicorn serving `app` on a thread of its own (rank 0's main thread runs the queue), as Gradio runs its server.

    The socket is bound here, in the caller's thread, so that a port taken since the launcher's check is an
    OSError for the caller rather than a message in uvicorn's log.
    """

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=int(CLOSE_SECONDS))
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            # as uvicorn binds (app.server.serve.check_port)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(config.backlog)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._server = uvicorn.Server(config)  # its signal handlers are the main thread's alone: none on this thread
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [listener]}, name="api-server",
                                        daemon=True)

    def start(self) -> None:
        """Serve; returns once uvicorn serves (OSError if it could not start)."""
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise OSError("the HTTP server did not start (its log above says why)")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop taking connections, give the requests still answering CLOSE_SECONDS, and stop."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=2 * CLOSE_SECONDS)
        self._listener.close()

"""`ulysses-studio serve`: the Gradio UI on rank 0, every rank generating in lockstep.

A server runs at most one image model and one video model, each on every rank: `--model` (image or
video) and `--video-model` (a second, video, model). With neither given it serves both embedded
tiny models, tiny-flux and tiny-cosmos, so both tabs work out of the box; with real checkpoints,
name only what fits in memory (each rank holds every transformer it serves).

A shared server holds each client to limits an operator may change: the denoising time of one
request (--max-request-seconds), the requests waiting (--max-queue), the size of an upload
(--max-upload-mb), the results kept in a chosen --out (--keep-results), and, with a login, failed
login attempts (app.server.access), counted per client address: a proxy's X-Forwarded-For is believed only from
a --trusted-proxy; and per owner (API key or login): its waiting requests (--max-queue-per-owner, owners taking
turns), uploads and results kept. Uploads and a temporary results folder go when the server ends; unused uploads
within a minute (app.server.submit.keep_house).

Every request is a row of the job store in the results folder (app.server.job_store): a start reads it back, failing the
job a stop interrupted and queueing again the ones that waited (app.server.submit.requeue).

The same port serves an OpenAI-compatible image and video API under /v1 (app.server.openai_api), sharing the
UI's queue and limits; with --api-key-file it asks for one of its keys, failed keys counting as failed
logins; with a UI login but no keys it is off. `--no-ui` serves that API alone, with GET /status and
GET /health, on uvicorn without Gradio (app.server.api_server), for teams putting the server behind their own tools.
Both servers answer GET /health, /ready, /status and /metrics (app.server.api_server.server_routes, app.server.metrics),
tag every request with an X-Request-Id (app.server.request_ids), and with --webhook-url tell a URL of each API video
job's end (app.server.webhooks). The HTTP server starts before the start-up calibration: /ready says 503 until it has
ended.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.commands.arguments import add_parallel_arguments, add_replicas_argument, run_options, served_lora_limits
from app.failures import RankLost
from app.outputs import OutputError, ResultsCap, check_results_folder, check_writer
from app.ranks.stopping import stop_on_signals, temporary_folder
from app.server.access import (
    AUTH_ENV,
    AuthError,
    LoginFailures,
    parse_trusted_proxies,
    read_api_keys,
    read_logins,
    trust_forwarded_headers,
)
from app.server.budget import DEFAULT_MAX_REQUEST_SECONDS
from app.server.request_ids import LOG_FORMATS, setup_logging
from app.server.webhooks import WebhookError, check_webhook_url, read_webhook_secret
from pipelines.registry import DEFAULT_IMAGE_MODEL, DEFAULT_VIDEO_MODEL, ModelNotFoundError, ModelSpec, resolve_model
from pipelines.requests import read_limits

if TYPE_CHECKING:
    from app.ranks.runtime import Runtime
    from app.server.api_server import Probes
    from app.server.openai_api import ApiAccess
    from app.server.submit import Server
    from app.server.webhooks import Webhooks


CLIENT_GRACE_SECONDS = 1.0
DEFAULT_MAX_QUEUE = 32
DEFAULT_MAX_QUEUE_PER_OWNER = 16
DEFAULT_MAX_UPLOAD_MB_PER_OWNER = 500.0
DEFAULT_MAX_RESULTS_MB_PER_OWNER = 10_000.0
DEFAULT_SIGNED_URL_SECONDS = 3600.0
HOUSEKEEPING_SECONDS = 5.0
"""How often the server deletes unused uploads and expired results (app.server.submit.keep_house)."""
DEFAULT_MAX_UPLOAD_MB = 100.0
UPLOADS_PREFIX = "ulysses-studio-uploads"


class ServeError(ValueError):
    """A serve command line that cannot start (busy port, bad --auth, two models of one media)."""


@dataclass(frozen=True)
class ServePlan:
    """A checked serve command line."""

    models: list[tuple[ModelSpec, Path]]
    logins: list[tuple[str, str]] | None
    """Rank 0's only: None on the other ranks, which never read them."""
    keep_results: ResultsCap | None
    trusted_proxies: list[str]
    """Addresses and networks whose X-Forwarded-For names the client (app.server.access); none by default."""
    api_keys: list[str] | None = None
    """The API's bearer keys (--api-key-file), rank 0's only; None: no key asked."""
    admin_keys: list[str] | None = None
    """Those of api_keys marked admin (`KEY admin`): they see every owner's jobs."""
    webhook_secret: str | None = None
    """The webhooks' signing secret (--webhook-secret-file), rank 0's only."""
    out: Path | None = None
    """--out as checked (app.outputs.check_results_folder), the folder the results go to; None: a temporary folder of
    the run's own, removed at its end."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model to serve, image or video (default: tiny-flux and tiny-cosmos together)")
    parser.add_argument("--model-path", default=None, metavar="DIR", help="a diffusers-format folder for --model")
    parser.add_argument("--video-model", default=None, help="a second model, for the video tab")
    parser.add_argument("--video-model-path", default=None, metavar="DIR",
                        help="a diffusers-format folder for --video-model")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for everyone)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on (default 7860)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (needs internet)")
    parser.add_argument("--no-ui", action="store_true",
                        help="serve the OpenAI-compatible API alone (/v1, with GET /status and GET /health), without "
                             "the web UI: Gradio is never loaded; with --api-key-file for keys, not --auth-file")
    parser.add_argument("--auth-file", default=None, metavar="FILE",
                        help=f"ask for a login: FILE has one USER:PASSWORD a line (or set ${AUTH_ENV}=USER:PASSWORD); "
                             "after 5 failed logins an address waits 1 s, then 2, 4, ... up to 60 s")
    parser.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                        help="ask for this login (shows the password in the process list: prefer --auth-file)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="ask the OpenAI-compatible API (/v1) for a key: FILE has one key a line (16 characters "
                             "or more), followed by the word admin for a key that sees every key's jobs; each key "
                             "sees its own alone; a wrong key counts as a failed login. Without it the API is open "
                             "where the UI is, and off where the UI asks for a login")
    parser.add_argument("--trusted-proxy", action="append", default=None, metavar="ADDR",
                        help="a reverse proxy in front of this server (IP address or network, e.g. 10.0.0.0/24; "
                             "repeat it or separate with commas): its X-Forwarded-For header names the client that "
                             "failed logins count against; from any other address the header is ignored "
                             "(default: none)")
    parser.add_argument("--open-metrics", action="store_true",
                        help="serve GET /metrics without a key (default: it asks for an --api-key-file key as /status "
                             "does, and is off where the API is)")
    parser.add_argument("--webhook-url", default=None, metavar="URL",
                        help="post OpenAI-style webhook events (video.completed, video.failed) of the API's video jobs "
                             "to URL, signed with --webhook-secret-file's secret; retried with backoff")
    parser.add_argument("--webhook-secret-file", default=None, metavar="FILE",
                        help="the webhooks' signing secret: FILE has one line, whsec_ and base64 (as OpenAI's)")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="the server's log on stderr (a line per API request with its X-Request-Id, video job "
                             "ends, webhook deliveries): text (default) or json (one object a line)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="folder for the results (default: a new temporary folder, removed when the server ends)")
    parser.add_argument("--keep-results", default=None, metavar="N|SIZE|AGE",
                        help="keep at most N result files (e.g. 500), SIZE of them (e.g. 2GB) or each for AGE (e.g. "
                             "24h, 7d) in the results folder, removing the oldest with their jobs; several, comma-"
                             "separated (e.g. 2GB,7d) (default: keep all)")
    parser.add_argument("--max-request-seconds", type=float, default=DEFAULT_MAX_REQUEST_SECONDS, metavar="S",
                        help="the most denoising time one request may take: longer ones are refused up front by an "
                             "estimate from the server's measured step times, or stopped once they pass it "
                             f"(default {DEFAULT_MAX_REQUEST_SECONDS:g}; 0: no limit)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                        help=f"requests that may wait for their turn; more are refused (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--max-upload-mb", type=float, default=DEFAULT_MAX_UPLOAD_MB, metavar="MB",
                        help=f"largest file a client may upload (default {DEFAULT_MAX_UPLOAD_MB:g})")
    parser.add_argument("--max-queue-per-owner", type=int, default=DEFAULT_MAX_QUEUE_PER_OWNER, metavar="N",
                        help="requests of one owner (API key or login) that may wait; owners take turns "
                             f"(default {DEFAULT_MAX_QUEUE_PER_OWNER})")
    parser.add_argument("--max-upload-mb-per-owner", type=float, default=DEFAULT_MAX_UPLOAD_MB_PER_OWNER,
                        metavar="MB", help="uploads one owner may hold: its waiting and running requests', and its UI "
                                           "uploads no request has used yet (without logins a UI client is its "
                                           f"address) (default {DEFAULT_MAX_UPLOAD_MB_PER_OWNER:g})")
    parser.add_argument("--max-results-mb-per-owner", type=float, default=DEFAULT_MAX_RESULTS_MB_PER_OWNER,
                        metavar="MB", help="results one owner may keep on the server; past it their requests are "
                                           f"refused (default {DEFAULT_MAX_RESULTS_MB_PER_OWNER:g}; 0: no limit)")
    parser.add_argument("--signed-url-seconds", type=float, default=DEFAULT_SIGNED_URL_SECONDS, metavar="S",
                        help="how long a signed URL of a result works (response_format url; the way to share a "
                             f"result) (default {DEFAULT_SIGNED_URL_SECONDS:g})")
    add_replicas_argument(parser)
    add_parallel_arguments(parser)


def check_serve(args: argparse.Namespace) -> ServePlan:
    """Resolve the models and the login, and probe the port, without loading anything (the launcher's check)."""
    plan = serve_plan(args)
    check_port(args.host, args.port)
    return plan


def serve_plan(args: argparse.Namespace) -> ServePlan:
    """Resolve the models and the login (pure: every rank gets the same answer)."""
    if not any((args.model, args.model_path, args.video_model, args.video_model_path)):
        models = [resolve_model(DEFAULT_IMAGE_MODEL, None), resolve_model(DEFAULT_VIDEO_MODEL, None)]
    else:
        models = []
        if args.model or args.model_path:
            models.append(resolve_model(args.model, args.model_path))
        if args.video_model or args.video_model_path:
            spec, folder = resolve_model(args.video_model, args.video_model_path)
            if spec.media != "video":
                raise ModelNotFoundError(f"--video-model '{spec.name}' makes images; pass it as --model")
            models.append((spec, folder))
        if len({spec.media for spec, _ in models}) < len(models):
            raise ServeError("both models make videos; a server runs one image model and one video model at most")
    for spec, _ in models:
        try:
            check_writer(spec)
        except OutputError as error:
            raise ServeError(f"{error}; or serve an image model alone (--model NAME)") from None
    # --lora: each served model takes the files that fit it (checked from its config); one that fits none is refused
    served_lora_limits(args, models, [read_limits(spec, folder) for spec, folder in models])
    if args.no_ui:
        _check_no_ui(args)
    for option in ("max_request_seconds", "max_upload_mb", "max_upload_mb_per_owner", "max_results_mb_per_owner",
                   "signed_url_seconds"):
        if not math.isfinite(getattr(args, option)):  # nan passes every comparison below; inf overflows int()
            raise ServeError(f"--{option.replace('_', '-')} must be a finite number, got {getattr(args, option)}")
    if args.max_request_seconds < 0 or args.max_queue < 1 or args.max_upload_mb <= 0:
        raise ServeError("--max-request-seconds must be at least 0, --max-queue at least 1, --max-upload-mb above 0")
    if (args.max_queue_per_owner < 1 or args.max_upload_mb_per_owner <= 0 or args.max_results_mb_per_owner < 0
            or args.signed_url_seconds <= 0):
        raise ServeError("--max-queue-per-owner must be at least 1, --max-upload-mb-per-owner and "
                         "--signed-url-seconds above 0, --max-results-mb-per-owner at least 0")
    out = check_results_folder(args.out) if args.out else None
    keep_results = None
    if args.keep_results is not None:
        try:
            keep_results = ResultsCap.parse(args.keep_results)
        except ValueError as error:
            raise ServeError(f"--keep-results: {error}") from None
    try:
        trusted_proxies = parse_trusted_proxies(args.trusted_proxy)
    except AuthError as error:
        raise ServeError(str(error)) from None
    if (args.webhook_url is None) != (args.webhook_secret_file is None):
        raise ServeError("--webhook-url and --webhook-secret-file go together: events are always signed")
    logins = api_keys = admin_keys = webhook_secret = None
    if int(os.environ.get("RANK", "0")) == 0:  # logins, keys and secrets are rank 0's business alone
        try:
            logins = read_logins(args.auth, args.auth_file)
            if args.api_key_file:
                api_keys, admin_keys = read_api_keys(args.api_key_file)
            if args.webhook_url is not None:
                check_webhook_url(args.webhook_url)
                webhook_secret = read_webhook_secret(args.webhook_secret_file)
        except (AuthError, WebhookError) as error:
            raise ServeError(str(error)) from None
    return ServePlan(models=models, logins=logins, keep_results=keep_results, trusted_proxies=trusted_proxies,
                     api_keys=api_keys, admin_keys=admin_keys, webhook_secret=webhook_secret, out=out)


def _check_no_ui(args: argparse.Namespace) -> None:
    """ServeError for what a server without its web UI cannot do: a public link to it, or logins to it (with no
    API keys they would leave nothing open to anyone)."""
    if args.share:
        raise ServeError("--share opens a public link to the web UI, and --no-ui serves none: leave one of them out")
    login = next((name for name, value in (("--auth", args.auth), ("--auth-file", args.auth_file),
                                           (f"${AUTH_ENV}", os.environ.get(AUTH_ENV))) if value), None)
    if login is not None:
        instead = ("leave it out: the API asks for the keys of --api-key-file" if args.api_key_file else
                   "ask for API keys instead (--api-key-file FILE)")
        raise ServeError(f"{login} asks for a login to the web UI, and --no-ui serves none: {instead}")


def check_port(host: str, port: int) -> None:
    """ServeError unless `host:port` can be listened on now."""
    if not 0 < port < 65536:
        raise ServeError(f"--port must be between 1 and 65535, got {port}")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As uvicorn binds: IPv6 for a host with a colon, and with SO_REUSEADDR, so that the TIME_WAIT
            # connections a server that just ended left behind do not refuse the port, while a live listener still
            # does (Linux).
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            probe.listen(1)
    except OSError as error:
        raise ServeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def _calibrate(runtime, budget) -> None:
    """Seed the time limit's cost models with two short requests per model (app.server.budget), before any client comes;
    where the run regroups, in every layout (on rank 0's group of it). A calibration that fails leaves the model to
    learn from the requests it serves."""
    from app.failures import JobFailed
    from app.server.budget import CALIBRATION_SECONDS, calibration_requests
    from app.server.jobs import calibrate
    from pipelines.requests import make_request

    for index, layout in enumerate(runtime.layouts):
        runtime.regroup(index)
        where = f" on {layout.label(0)}" if runtime.regroups else ""
        for key, model in runtime.models.items():
            if runtime.service.stop_event.is_set():  # Ctrl-C while calibrating
                return
            default = make_request(model.spec, model.limits, prompt="a calibration run", seed=0, lora=())  # as served
            limits = model.limits
            first, candidates = calibration_requests(default,
                                                     min_frames=max(limits.min_frames, 1 + limits.frame_multiple),
                                                     max_height=limits.max_height, max_width=limits.max_width,
                                                     multiple=limits.size_multiple)
            try:
                lines = calibrate(layout.service, budget, key, first, candidates, CALIBRATION_SECONDS, index)
            except JobFailed as error:
                print(f"warning: {model.spec.name}'s time estimates{where} start unmeasured: its calibration failed "
                      f"({error})", file=sys.stderr, flush=True)
                continue
            print(f"calibrated {model.spec.name}'s time estimates{where}: {'; '.join(lines)}", file=sys.stderr,
                  flush=True)
    runtime.regroup(0)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (rank 0 runs the UI, or the API alone, and the queue; other ranks follow)."""
    plan = serve_plan(args)
    setup_logging(args.log_format)
    if not args.no_ui:
        # Gradio's usage analytics would try the network on every start; this runs offline.
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

    from app.ranks.runtime import start_runtime

    with stop_on_signals() as stop, start_runtime(plan.models, run_options(args), stop=stop,
                                                  replicas=args.replicas) as runtime:
        if not runtime.is_main:
            runtime.follow()
            return 0
        # Uploads in a folder of this server's (inside $GRADIO_TEMP_DIR where set): removed on exit, and by the next
        # start after a SIGKILL. With the UI it is Gradio's cache too (uploads, and copies of the results it serves),
        # read by Gradio when it is imported (_start_ui).
        uploads_dir = temporary_folder(UPLOADS_PREFIX, parent=os.environ.get("GRADIO_TEMP_DIR"))
        if not args.no_ui:
            os.environ["GRADIO_TEMP_DIR"] = str(uploads_dir)
        from app.outputs import ResultsFolder
        from app.server.api_server import Probes, serving_health, serving_readiness
        from app.server.budget import RequestBudget, counted_work
        from app.server.job_store import STORE_NAME, JobStore
        from app.server.jobs import SHUTTING_DOWN, JobQueue, closing_reason, serve_jobs
        from app.server.metrics import ServerMetrics
        from app.server.openai_api import api_access
        from app.server.submit import Quotas, Server, keep_house, requeue, restore_galleries
        from app.server.uploads import Uploads

        out_dir = plan.out or temporary_folder("ulysses-studio")
        out_dir.mkdir(parents=True, exist_ok=True)
        from pipelines.work import WorkCounter

        budget = RequestBudget(args.max_request_seconds or None,
                               {key: counted_work(WorkCounter(model.spec, model.folder, model.limits), model.spec.name)
                                for key, model in runtime.models.items()}, layouts=len(runtime.layouts))
        store = JobStore(out_dir / STORE_NAME)
        mb = 1e6
        quotas = Quotas(upload_bytes=int(args.max_upload_mb_per_owner * mb),
                        result_bytes=int(args.max_results_mb_per_owner * mb) or None,
                        url_seconds=args.signed_url_seconds)
        metrics = ServerMetrics({key: model.spec.name for key, model in runtime.models.items()})
        server = Server(jobs=JobQueue(args.max_queue, args.max_queue_per_owner, on_end=metrics.job_ended),
                        budget=budget, results=ResultsFolder(out_dir, plan.keep_results), uploads=Uploads(uploads_dir),
                        store=store, quotas=quotas, metrics=metrics)
        jobs = server.jobs
        metrics.watch(jobs, lambda: runtime.layouts[runtime.active].replicas)
        warm = threading.Event()
        """Set once the start-up calibration has ended: GET /ready says 503 until then."""
        health = serving_health(runtime, jobs, stop)
        probes = Probes(health=health, ready=serving_readiness(health, warm), metrics=metrics,
                        open_metrics=args.open_metrics)
        webhooks = None
        if args.webhook_url is not None:
            from app.server.webhooks import Webhooks

            webhooks = Webhooks(args.webhook_url, plan.webhook_secret)
            webhooks.start()
        restore_galleries(runtime, server)
        requeued = requeue(runtime, server)
        if requeued:
            print(f"queued again after the restart: {len(requeued)} job{'s' * (len(requeued) > 1)}", file=sys.stderr,
                  flush=True)
        housekeeping = _every(HOUSEKEEPING_SECONDS, lambda: keep_house(server))

        def remove_files() -> None:
            shutil.rmtree(uploads_dir, ignore_errors=True)
            if plan.out is None:  # a folder this run made; the user's own --out stays
                shutil.rmtree(out_dir, ignore_errors=True)

        def abandon() -> str:
            # app.ranks.stopping's watchdog, when SIGTERM found the main thread stuck (in a collective with a dead
            # rank): tell the waiting clients why, give them a moment to hear it, clean up.
            reason = closing_reason(runtime)
            for job in jobs.running():
                job.fail(reason)
            jobs.close(reason)
            time.sleep(CLIENT_GRACE_SECONDS)
            remove_files()
            return runtime.service.lost_message()

        stop.abandon = abandon
        # Failed API keys and failed UI logins count together.
        failures = LoginFailures()
        access = api_access(plan.api_keys, bool(plan.logins), failures, plan.admin_keys)
        trust_forwarded_headers(plan.trusted_proxies, os.environ)  # read by uvicorn as it starts, just below

        def close() -> None:  # replaced by the server's own once one has started
            pass

        lost = False
        try:
            try:
                if args.no_ui:
                    close, where = _start_api(args, runtime, server, access, probes, webhooks)
                else:
                    close, where = _start_ui(args, plan, runtime, server, access, out_dir, probes, webhooks)
            except OSError as error:
                raise ServeError(f"cannot listen on {args.host}:{args.port}: {error}") from None
            if budget.max_seconds is not None:  # requests that come meanwhile wait in the queue; /ready says 503
                _calibrate(runtime, budget)
            warm.set()
            print(f"serving on {where} · {runtime.describe()} · results in {out_dir} · Ctrl-C stops", file=sys.stderr,
                  flush=True)
            serve_jobs(runtime, jobs, stop, budget)
        except RankLost:
            lost = True
            raise
        finally:
            reason = closing_reason(runtime)
            jobs.close(reason)
            if lost or jobs.failed_at_close or reason != SHUTTING_DOWN:
                # Let the handler threads hand the failure to their clients before the server closes (where a rank
                # is gone, also a request still on its way to the queue: its handler is refused with the reason).
                time.sleep(CLIENT_GRACE_SECONDS)
            close()
            housekeeping.set()  # the store stays open: handlers may still write the rows of jobs that ended
            if webhooks is not None:
                webhooks.close()
            remove_files()
    print("stopped", file=sys.stderr)
    return 0


def _every(seconds: float, work: Callable[[], None]) -> threading.Event:
    """Run `work` every `seconds` on a thread of its own until the event returned is set (its errors are printed)."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(seconds):
            try:
                work()
            except Exception:  # a clean-up that failed once may work next time; the server goes on
                traceback.print_exc()

    threading.Thread(target=loop, name="housekeeping", daemon=True).start()
    return done


def _start_ui(args: argparse.Namespace, plan: ServePlan, runtime: Runtime, server: Server, access: ApiAccess,
              out_dir: Path, probes: Probes, webhooks: Webhooks | None) -> tuple[Callable[[], None], str]:
    """Start Gradio's server with the UI and the API (on its thread); returns its close and where it serves."""
    # Results are served from their folder as they are: Gradio copies any other file it returns into its cache
    # (one copy per result, for the server's life, whatever --keep-results removes).
    import gradio as gr
    from starlette.middleware import Middleware

    from app.server.api_server import server_middleware, server_routes
    from app.server.gradio_paths import ServerPaths
    from app.server.openai_api import PREFIX, api_routes
    from app.server.ui import OwnResults, build_ui

    gr.set_static_paths([out_dir])
    demo = build_ui(runtime, server)
    # The API's routes come first in the app, so that none of Gradio's answers under /v1; then the server's own.
    routes = [*api_routes(runtime, server, access, int(args.max_upload_mb * 1e6), webhooks),
              *server_routes(runtime, server, access, probes)]
    try:
        _, local_url, share_url = demo.launch(
            server_name=args.host, server_port=args.port, share=args.share,
            auth=[tuple(login) for login in plan.logins] if plan.logins else None,
            prevent_thread_lock=True, allowed_paths=[str(out_dir)], ssr_mode=False, show_error=True,
            quiet=True, max_file_size=int(args.max_upload_mb * 1e6),
            app_kwargs={"middleware": [*server_middleware(access),
                                       Middleware(ServerPaths, uploads=server.uploads.folder, results=out_dir,
                                                  upload_quota=server.quotas.upload_bytes),
                                       Middleware(OwnResults, store=server.store)],
                        "routes": routes},
        )
    except OSError:
        demo.close()
        raise
    where = (f"{local_url}" + (f" and {share_url}" if share_url else "")
             + f" (OpenAI-compatible API: {local_url.rstrip('/')}{PREFIX})")
    return demo.close, where


def _start_api(args: argparse.Namespace, runtime: Runtime, server: Server, access: ApiAccess, probes: Probes,
               webhooks: Webhooks | None) -> tuple[Callable[[], None], str]:
    """Start uvicorn with the API alone (on its thread; Gradio never imported); returns its close and where it
    serves."""
    from app.server.api_server import ApiServer, api_app, display_url
    from app.server.openai_api import PREFIX

    app = api_app(runtime, server, access, int(args.max_upload_mb * 1e6), probes, webhooks)
    front = ApiServer(app, args.host, args.port)
    front.start()
    url = display_url(args.host, args.port)
    return front.close, (f"{url}{PREFIX} (the OpenAI-compatible API alone, no UI; also {url}/status, {url}/health, "
                         f"{url}/ready and {url}/metrics)")

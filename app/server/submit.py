"""From a client's fields to a queued job, and from its generation to a written result: what the UI
(app.server.ui) and the OpenAI-compatible API (app.server.openai_api) share, so that both check, queue and write a
request alike.

`submit` validates (make_request, the one place a request is checked, then the server's time limit and the
owner's quotas) off the event loop, writes the job's row in the job store (app.server.job_store) and queues the job; an
upload the request brings is deleted once the job ends or is refused. `write` writes the result file with its
settings (server.results.write) off the loop, records it in the job's row, holds the results folder to its cap,
and returns the settings a client gets back: the request's, and where the time went. `finish_later` does what a
waiting handler does for a job nobody waits on (a video job, a job queued again after a restart: `requeue`).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.outputs import RecentResults, ResultsFolder, settings_of
from app.ranks.lockstep import STOPPED, Generation
from app.ranks.runtime import Runtime, ServedModel
from app.server.budget import LIMIT_OPTION, RequestBudget, duration
from app.server.job_store import INTERRUPTED, JobRow, JobStore
from app.server.jobs import Finished, Job, JobQueue
from app.server.uploads import Uploads
from app.stage_times import LastRequest, RequestTimes
from pipelines.requests import GenerationRequest, RequestError, make_request

if TYPE_CHECKING:
    from app.server.metrics import ServerMetrics

RANDOM_SEED_LIMIT = 2**32
"""A seed the server picks is below this."""


class OverQuota(RuntimeError):
    """An owner's uploads or results are over their share of the server (the message says which, and the limit)."""


@dataclass(frozen=True, kw_only=True)
class Quotas:
    """What one owner may hold of a shared server (None: no limit)."""

    upload_bytes: int | None = None
    """Bytes of uploads its waiting and running jobs hold (--max-upload-mb-per-owner)."""
    result_bytes: int | None = None
    """Bytes of its results kept (--max-results-mb-per-owner)."""
    url_seconds: float = 3600.0
    """How long a signed URL of a result works (--signed-url-seconds)."""


@dataclass(frozen=True, kw_only=True)
class Server:
    """What the handlers share: the queue, the time limit, the results folder, the uploads in use, the job store
    and the owners' quotas."""

    jobs: JobQueue
    budget: RequestBudget
    results: ResultsFolder
    uploads: Uploads
    store: JobStore
    quotas: Quotas = field(default_factory=Quotas)
    live: dict[str, Job] = field(default_factory=dict)
    """The jobs waiting or running, by their row's id (what DELETE cancels)."""
    recent: RecentResults = field(default_factory=RecentResults)
    last_request: LastRequest = field(default_factory=LastRequest)
    """The times of the last result written (its write included): the status line's."""
    metrics: ServerMetrics | None = None
    """Where each result's write time is counted (GET /metrics); the rest is counted as jobs end
    (app.server.metrics)."""


@dataclass(frozen=True)
class Submitted:
    """A queued job, its checked request, its time estimate (None before the model is measured) and its row's id."""

    job: Job
    request: GenerationRequest
    estimate: float | None
    id: str = ""


def random_seed() -> int:
    return secrets.randbelow(RANDOM_SEED_LIMIT)


async def submit(model: ServedModel, server: Server, *, owner: str = "anyone", copies: int = 1,
                 **fields: Any) -> Submitted:
    """Check `fields` (make_request's), the time limit (for `copies` such requests together: an API request's n) and
    `owner`'s quotas, off the event loop, then write the job's row and queue it. The default of `lora` is none: a
    client that names no LoRA gets none (the command line's defaults are generate's and batch's).

    Raises RequestError (a bad request, or over the time limit), OverQuota, ServiceBusy (queue full) or
    ServiceClosed. An upload in `fields["condition"]` is deleted once the job ends, or at once if it is refused.
    """
    await asyncio.to_thread(server.uploads.remove_orphans)
    upload = fields.get("condition")
    if upload:
        server.uploads.use(upload)  # this call's hold: a refused request's upload goes at once
    if fields.get("lora") is None:  # a served request that names no LoRA gets none (generate and batch: every --lora)
        fields["lora"] = ()
    try:
        if upload and server.uploads.holds(upload) and not Path(upload).is_file():
            raise RequestError(f"input file {Path(upload).name} is no longer on the server: an upload that no request "
                               "uses goes within a minute; upload it again")
        request = await asyncio.to_thread(make_request, model.spec, model.limits, **fields)
        estimate = await asyncio.to_thread(server.budget.check, model.key, request)  # counts FLOPs: off the loop
        limit = server.budget.max_seconds
        if copies > 1 and limit is not None and estimate is not None and copies * estimate > limit:
            raise RequestError(f"n={copies} images would take about {duration(copies * estimate)} together; this "
                               f"server's limit is {duration(limit)} a request ({LIMIT_OPTION}): ask for fewer "
                               "images, fewer steps or a smaller size")
        held = request.condition is not None and server.uploads.holds(request.condition)
        upload_bytes = Path(request.condition).stat().st_size if held else 0
        await asyncio.to_thread(check_quotas, server, owner, upload_bytes)
        row = JobRow(id=f"{model.spec.media}_{uuid.uuid4().hex}", owner=owner, kind=model.spec.media,
                     model=model.spec.name, request=request.to_dict(), settings=settings_of(request, model.spec),
                     upload_bytes=upload_bytes)
        await asyncio.to_thread(server.store.add, row)
        try:
            return queue_row(model, server, row, request, estimate)
        except BaseException:
            await asyncio.to_thread(server.store.delete, row.id)  # refused: no job
            raise
    finally:
        if upload:
            await asyncio.to_thread(server.uploads.release, upload)


def check_quotas(server: Server, owner: str, upload_bytes: int) -> None:
    """OverQuota if `owner` may not queue a job that brings `upload_bytes` of upload."""
    held, kept = server.store.usage(owner)
    quotas = server.quotas
    if quotas.upload_bytes is not None and upload_bytes and held + upload_bytes > quotas.upload_bytes:
        raise OverQuota(f"your waiting requests hold {held / 1e6:.1f} MB of uploads, and this one brings "
                        f"{upload_bytes / 1e6:.1f} MB: this server's most for one client is "
                        f"{quotas.upload_bytes / 1e6:g} MB (--max-upload-mb-per-owner); try again once they have run")
    if quotas.result_bytes is not None and kept >= quotas.result_bytes:
        raise OverQuota(f"your results take {kept / 1e6:.1f} MB here, this server's most for one client "
                        f"({quotas.result_bytes / 1e6:g} MB, --max-results-mb-per-owner): delete some, or wait "
                        "for them to expire")


def queue_row(model: ServedModel, server: Server, row: JobRow, request: GenerationRequest,
              estimate: float | None) -> Submitted:
    """Queue the job of a stored row (its upload held until it ends); raises ServiceBusy or ServiceClosed."""
    upload = request.condition if row.upload_bytes else None
    if upload:
        server.uploads.use(upload)

    def done() -> None:
        server.live.pop(row.id, None)
        if upload:
            server.uploads.release(upload)

    try:
        job = server.jobs.submit(model.key, request, when_done=done, estimate=estimate, owner=row.owner,
                                 changed=partial(record, server.store, row.id))
    except BaseException:
        if upload:
            server.uploads.release(upload)
        raise
    server.live[row.id] = job
    if job.ended:  # it ended before it was listed: done() found nothing to drop
        server.live.pop(row.id, None)
    return Submitted(job, request, estimate, row.id)


def failure_code(message: str) -> str:
    """The code of a failed job's error: "server_unavailable" where the server stopped or lost a rank (its own
    messages start "the server"), else "generation_failed"."""
    return "server_unavailable" if message.startswith("the server") else "generation_failed"


def record(store: JobStore, job_id: str, **changes: Any) -> None:
    """A job's move, into its row (Job.changed): a failure's message as {"code", "message"}, no server path in it;
    a job the server's stop ended is "interrupted" (what its row says once the server is back)."""
    if isinstance(changes.get("error"), str):
        message = public_message(changes["error"])
        if failure_code(message) == "server_unavailable" or message.startswith(STOPPED):
            changes["error"] = {"code": "interrupted", "message": f"{INTERRUPTED} ({message})"}
        else:
            changes["error"] = {"code": "generation_failed", "message": message}
    store.change(job_id, **changes)


async def write(model: ServedModel, server: Server, submitted: Submitted, generation: Generation,
                owner: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Write a finished job's result (off the event loop) and return its path and settings (the file's, and
    its times); `owner`: whose recent results it joins (app.server.ui.Owners; None: no gallery's)."""
    request, estimate = submitted.request, submitted.estimate
    # The ranks are on the next job already: this handler's thread writes while they work.
    write_started = time.perf_counter()
    ran_on = submitted.job.ran_on
    try:
        path = await asyncio.to_thread(server.results.write, generation.result, request, model.spec,
                                       generation.computed_steps, ran_on)
    except Exception as error:
        await asyncio.to_thread(server.store.change, submitted.id, status="failed", completed_at=time.time(),
                                error={"code": "write_failed", "message": public_message(str(error))})
        raise
    settings = settings_of(request, model.spec, generation.computed_steps, ran_on)
    job = submitted.job
    settings.update(seconds=round(generation.seconds, 3), step_seconds=round(generation.step_seconds, 4),
                    estimate_seconds=None if estimate is None else round(estimate, 3),
                    ran_from=[round(job.started_time, 3), round(job.ended_time, 3)])  # when its group had it (epoch s)
    stages = None
    if generation.stages is not None:
        stages = generation.stages.with_write(time.perf_counter() - write_started)
        settings["stages"] = stages.to_dict()
        if server.metrics is not None:
            server.metrics.written(model.spec.name, stages.write)
    computed = None if generation.computed_steps is None else (generation.computed_steps, request.steps)
    server.last_request.set(RequestTimes(step_seconds=generation.step_seconds, stages=stages, computed_steps=computed))
    if owner is not None:
        server.recent.add(model.key, owner, path, settings)
    ended = time.time()
    age = server.results.cap.seconds if server.results.cap is not None else None
    row = await asyncio.to_thread(server.store.change, submitted.id, status="completed", progress=100,
                                  settings=settings, completed_at=ended,
                                  expires_at=None if age is None else ended + age,
                                  files={path.name: path.stat().st_size})
    if row is None:  # deleted by its owner while it was written
        await asyncio.to_thread(path.unlink, missing_ok=True)
    await asyncio.to_thread(keep_results, server, path)
    return path, settings


def keep_results(server: Server, keep: Path | None = None) -> list[JobRow]:
    """Hold the results to --keep-results: the files beyond its cap go with their jobs' rows, and the jobs past their
    expires_at with their files (never `keep`, the newest); returns the rows that went."""
    removed = server.results.prune(keep=keep)
    evicted = server.store.evict(files=[path.name for path in removed])
    for row in evicted:
        for name in row.files:
            (server.results.folder / name).unlink(missing_ok=True)
    return evicted


def finish_later(model: ServedModel, server: Server, submitted: Submitted, owner: str | None = None
                 ) -> threading.Thread:
    """Wait for a job nobody waits on in a thread of its own, and write its result (its row says how it went);
    `owner`: whose UI gallery it joins (write's)."""

    async def finish() -> None:
        async for event in submitted.job.follow():
            if isinstance(event, Finished):
                try:
                    await write(model, server, submitted, event.generation, owner)
                except Exception as error:  # its row says so (write); the server goes on
                    print(f"{submitted.id}: its result could not be written: {error}", file=sys.stderr, flush=True)

    thread = threading.Thread(target=lambda: asyncio.run(finish()), name=f"finish-{submitted.id}", daemon=True)
    thread.start()
    return thread


def requeue(runtime: Runtime, server: Server) -> list[Submitted]:
    """At start-up: fail the job a stop interrupted, and queue again the jobs that were waiting (JobStore.recover),
    each finished by finish_later; a job that cannot be queued again is failed saying why."""
    models = {model.spec.name: model for model in runtime.models.values()}
    queued = []
    for row in server.store.recover():
        model = models.get(row.model)
        if model is None:
            why = f"its model {row.model!r} is not served since the server restarted"
        elif row.upload_bytes and not Path(row.request["condition"]).is_file():
            why = "its input file did not survive the server's restart (uploads go when a server stops): send it again"
        else:
            try:
                request = make_request(model.spec, model.limits, **row.request)
                submitted = queue_row(model, server, row, request, server.budget.estimate(model.key, request))
            except Exception as error:  # RequestError, ServiceBusy: the job's row says why
                why = f"it could not be queued again after the server's restart: {error}"
            else:
                finish_later(model, server, submitted, row.owner)  # a UI owner finds it in the tab's gallery
                queued.append(submitted)
                continue
        record(server.store, row.id, status="failed", completed_at=time.time(), error=why)
    return queued


UI_OWNERS = ("user:", "browser:")
"""The owners a UI page has (app.server.ui.Owners): a login's user, or a browser's id."""


def restore_galleries(runtime: Runtime, server: Server, most: int = 2000) -> int:
    """At start-up: the UI owners' completed results (of the newest `most` jobs of each media) back into their tabs'
    galleries, as before the restart; returns how many."""
    keys = {model.spec.name: model.key for model in runtime.models.values()}
    rows = [row for kind in ("image", "video") for row in server.store.page(None, kind, limit=most)[0]
            if row.status == "completed" and row.files and row.model in keys and row.owner.startswith(UI_OWNERS)]
    restored = 0
    for row in sorted(rows, key=lambda row: row.completed_at or 0.0):  # oldest first: a gallery shows the newest first
        path = server.results.folder / row.files[0]
        if path.is_file():
            server.recent.add(keys[row.model], row.owner, path, row.settings or {})
            restored += 1
    return restored


def keep_house(server: Server) -> None:
    """The server's periodic clean-up: unused uploads (Uploads.sweep), expired results and their rows."""
    server.uploads.sweep()
    keep_results(server)


def server_line(runtime: Runtime, server: Server, details: bool = True) -> str:
    """The status line's first part (Runtime.describe): models, what runs them, and the last client request's times
    (the start-up calibration's never count); `details`: then the technical details (Runtime.describe_details)."""
    last = server.last_request.get()
    times = () if last is None else (last.step_seconds, last.computed_steps, last.stages)
    return runtime.describe(*times) if details else runtime.describe_plainly(*times)


_SERVER_PATH = re.compile(r"(?<![\w:/.])/(?:[^\s/'\"]+/)+([^\s/'\"]+)")


def public_message(text: str) -> str:
    """`text` with every absolute path cut to its last part: a client is told which file, never where the
    server keeps it (uploads, results, model folders)."""
    return _SERVER_PATH.sub(r"\1", text)

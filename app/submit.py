"""From a client's fields to a queued job, and from its generation to a written result: what the UI
(app.ui) and the OpenAI-compatible API (app.openai_api) share, so that both check, queue and write a
request alike.

`submit` validates (make_request, the one place a request is checked, then the server's time limit)
off the event loop and queues the job; an upload the request brings is deleted once the job ends or
is refused. `write` writes the result file with its settings (server.results.write) off the loop and
returns the settings a client gets back: the request's, and where the time went.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.budget import RequestBudget
from app.jobs import Job, JobQueue
from app.lockstep import Generation
from app.outputs import RecentResults, ResultsFolder, settings_of
from app.runtime import Runtime, ServedModel
from app.stage_times import LastRequest, RequestTimes
from app.uploads import Uploads
from pipelines.requests import GenerationRequest, make_request

if TYPE_CHECKING:
    from app.metrics import ServerMetrics

RANDOM_SEED_LIMIT = 2**32
"""A seed the server picks is below this."""


@dataclass(frozen=True, kw_only=True)
class Server:
    """What the handlers share: the queue, the time limit, the results folder and the uploads in use."""

    jobs: JobQueue
    budget: RequestBudget
    results: ResultsFolder
    uploads: Uploads
    recent: RecentResults = field(default_factory=RecentResults)
    last_request: LastRequest = field(default_factory=LastRequest)
    """The times of the last result written (its write included): the status line's."""
    metrics: ServerMetrics | None = None
    """Where each result's write time is counted (GET /metrics); the rest is counted as jobs end (app.metrics)."""


@dataclass(frozen=True)
class Submitted:
    """A queued job, its checked request and its time estimate (None before the model is measured)."""

    job: Job
    request: GenerationRequest
    estimate: float | None


def random_seed() -> int:
    return secrets.randbelow(RANDOM_SEED_LIMIT)


async def submit(model: ServedModel, server: Server, **fields: Any) -> Submitted:
    """Check `fields` (make_request's) and the time limit, off the event loop, then queue the job. The default
    of `lora` is none: a client that names no LoRA gets none (the command line's defaults are generate's and batch's).

    Raises RequestError (a bad request, or over the time limit), ServiceBusy (queue full) or ServiceClosed.
    An upload in `fields["condition"]` is deleted once the job ends, or at once if it is refused.
    """
    await asyncio.to_thread(server.uploads.remove_orphans)
    upload = fields.get("condition")
    release = None
    if upload:
        server.uploads.use(upload)
        release = partial(server.uploads.release, upload)
    job = None
    if fields.get("lora") is None:  # a served request that names no LoRA gets none (generate and batch: every --lora)
        fields["lora"] = ()
    try:
        request = await asyncio.to_thread(make_request, model.spec, model.limits, **fields)
        estimate = await asyncio.to_thread(server.budget.check, model.key, request)  # counts FLOPs: off the loop
        job = server.jobs.submit(model.key, request, when_done=release, estimate=estimate)
    finally:
        if job is None and release is not None:
            release()
    return Submitted(job, request, estimate)


async def write(model: ServedModel, server: Server, submitted: Submitted, generation: Generation,
                owner: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Write a finished job's result (off the event loop) and return its path and settings (the file's, and
    its times); `owner`: whose recent results it joins (app.ui.Owners; None: no gallery's)."""
    request, estimate = submitted.request, submitted.estimate
    # The ranks are on the next job already: this handler's thread writes while they work.
    write_started = time.perf_counter()
    ran_on = submitted.job.ran_on
    path = await asyncio.to_thread(server.results.write, generation.result, request, model.spec,
                                   generation.computed_steps, ran_on)
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
    return path, settings


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

"""Rank 0's request queue: UI handlers submit jobs, the main thread runs them one at a time.

Concurrent users are queued, never interleaved: the lockstep service runs one request on all ranks
at a time. Owners take turns: the next job is the oldest of the owner served longest ago (an owner
never served first), so one client's many queued jobs do not hold back another's single one; one
owner's jobs run in their order. Each job carries its own event stream (Started when its turn comes, step
progress, then a result or a failure) back to the handler that submitted it (Job.follow, an async iterator that
the ranks' threads wake), and tells its store row of each move (Job.changed). A handler whose client
cancelled or left cancels its job: a waiting job is dropped when its turn comes, a running one is
stopped by every rank at the next step. The queue holds at most `max_waiting` wanted jobs besides the
running one (a cancelled one waiting for its turn holds no place), and at most `per_owner` of one owner's;
more are refused (ServiceBusy, with the seconds until a place should free), so that a
flood of requests gets an answer at once rather than hours of waiting.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from app.failures import JobCancelled, JobFailed, RankLost
from app.ranks.lockstep import Generation, LockstepService
from app.ranks.runtime import Runtime
from app.server.budget import RequestBudget, RequestClock, duration
from pipelines.requests import GenerationRequest

POLL_SECONDS = 0.2
"""How often the main loop looks at the other groups' threads as they end."""
RETRY_SECONDS = 10.0
"""What a refused client is told to wait where no running job has an estimate yet."""
PROGRESS_SECONDS = 0.5
"""The most often a running job's row is told its progress (its first step is always told)."""
MAX_OWNERS = 10_000
"""Owners whose last turn the queue remembers (the least recently served are forgotten beyond it)."""
IDLE_SECONDS = 0.1
"""The longest an idle group waits before it looks again at its heartbeat clock, the stop flag and the other groups
(a job that arrives wakes it at once: JobQueue.wait_for_job)."""


class ServiceClosed(RuntimeError):
    """The server is shutting down and takes no more requests."""


class ServiceBusy(RuntimeError):
    """The queue is full (or the owner's share of it); the message says so, and what the limit is.
    `retry_after`: the seconds until a place should free, by the running jobs' estimates."""

    def __init__(self, message: str, retry_after: float = RETRY_SECONDS) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Started:
    """The job left the queue: the ranks are encoding its prompt (its first Step follows)."""


@dataclass(frozen=True)
class Step:
    done: int
    total: int


@dataclass(frozen=True)
class Finished:
    generation: Generation


@dataclass(frozen=True)
class Failed:
    message: str


JobEvent = Started | Step | Finished | Failed
"""What happens to a job, in order: Started, its Steps, then one Finished or Failed (its last)."""


class Job:
    """One submitted request and the stream of what happens to it."""

    def __init__(self, model: str, request: GenerationRequest, when_done: Callable[[], None] | None = None,
                 estimate: float | None = None, on_end: JobCallback | None = None, *, owner: str = "",
                 changed: Callable[..., None] | None = None) -> None:
        self.model = model
        self.request = request
        self.owner = owner
        """Who asked for it (app.server.job_store.JobRow.owner): the queue's turns are per owner."""
        self.changed = changed or (lambda **changes: None)
        """Called with its row's changes as it moves (status, progress, times, error): app.server.submit's record."""
        self.estimate = estimate
        """Seconds the server's cost model expects it to hold the ranks (None: no estimate yet)."""
        self.submitted_at = time.monotonic()
        """time.monotonic() when it was queued (its queue time and latency are measured from it)."""
        self.started_at: float | None = None
        """time.monotonic() when its turn came."""
        self.started_time: float | None = None
        self.ended_time: float | None = None
        """time.time() when its turn came and when it ended (the settings a client gets record them)."""
        self.group = ""
        """The group of ranks that runs it ("" when the ranks are one group)."""
        self.plan = ""
        """That group's plan (how its ranks split the transformer)."""
        self.ranks = 0
        """How many ranks that group has."""
        self.cancelled: str | None = None
        """Why the job's client no longer wants it (set once, by cancel)."""
        self.steps_done = 0
        self.cancelled_after = 0
        """steps_done when cancel was called: how late the ranks stopped is measured from it."""
        self._events: deque[JobEvent] = deque()
        """Its events not yet taken by its follower (under _lock)."""
        self._lock = threading.Lock()
        self._wake: Callable[[], None] | None = None
        """Its follower's wake-up (follow), called in whatever thread adds an event."""
        self._progress_told = 0.0
        """time.monotonic() when its row last heard of its progress."""
        self._ended = False
        self._when_done = when_done
        """Called once the job has finished or failed (e.g. to delete the upload it used)."""
        self._on_end = on_end
        """Its queue's listener (JobQueue's on_end), told how every job ends."""

    def cancel(self, reason: str) -> None:
        """Drop the job: at its turn if it waits, at the next step on every rank if it runs."""
        if self.cancelled is None:
            self.cancelled_after = self.steps_done
            self.cancelled = reason

    def start(self, group: str = "", plan: str = "", ranks: int = 0) -> None:
        self.group, self.plan, self.ranks = group, plan, ranks
        self.started_at = time.monotonic()
        self.started_time = time.time()
        self.changed(status="in_progress", started_at=self.started_time, progress=0)
        self._add(Started())

    def describe(self, name: str, now: float | None = None) -> str:
        """What the status line says of it: model, size, and once running its step (after the last one: decoding)
        and time."""
        request = self.request
        size = f"{request.width}x{request.height}" + (f", {request.frames} frames" if request.frames > 1 else "")
        about = f" of about {duration(self.estimate)}" if self.estimate is not None else ""
        if self.started_at is None:
            return f"{name} {size}, {request.steps} steps" + (f" (about {duration(self.estimate)})" if about else "")
        elapsed = (time.monotonic() if now is None else now) - self.started_at
        where = f" on {self.group}" if self.group else ""
        stage = "decoding" if self.steps_done >= request.steps else f"step {self.steps_done} of {request.steps}"
        return f"{name} {size}, {stage}, {duration(elapsed)}{about}{where}"

    def to_dict(self, name: str, now: float | None = None) -> dict[str, Any]:
        """What describe says, as data (GET /status of `serve --no-ui`): model, size, steps, estimate, and once
        running its step, seconds so far and group."""
        request = self.request
        about = None if self.estimate is None else round(self.estimate, 3)
        state: dict[str, Any] = {"model": name, "size": f"{request.width}x{request.height}", "frames": request.frames,
                                 "steps": request.steps, "estimate_seconds": about}
        if self.started_at is not None:
            elapsed = (time.monotonic() if now is None else now) - self.started_at
            state.update(step=self.steps_done, seconds=round(elapsed, 3), group=self.group or None)
        return state

    def step(self, done: int, total: int) -> None:
        self.steps_done = done
        now = time.monotonic()
        if now - self._progress_told >= PROGRESS_SECONDS:  # a row's write is synced to disk: not at every step
            self._progress_told = now
            self.changed(progress=min(99, 100 * done // max(total, 1)))
        self._add(Step(done, total))

    def finish(self, generation: Generation) -> None:
        self._end(Finished(generation))

    def fail(self, message: str, record: bool = True) -> None:
        """End the job with `message`; `record`: tell its row (a queue that closes does not: its waiting jobs stay
        queued in the store, for the next start to run)."""
        if record and not self._ended:
            self.changed(status="failed", completed_at=time.time(), error=message)
        self._end(Failed(message))

    @property
    def ran_on(self) -> dict[str, str] | None:
        """Where the ranks form several groups: which group and plan ran it (for its file, settings, manifest)."""
        return {"group": self.group, "plan": self.plan} if self.group else None

    @property
    def ended(self) -> bool:
        return self._ended

    def _end(self, event: Finished | Failed) -> None:
        self.ended_time = time.time()
        self._ended = True
        callback, self._when_done = self._when_done, None
        listener, self._on_end = self._on_end, None
        try:
            if callback is not None:
                callback()
        except Exception:  # a clean-up that failed must not keep the job's client waiting
            traceback.print_exc()
        try:
            if listener is not None:
                listener(self, event.generation if isinstance(event, Finished) else event.message)
        except Exception:  # nor may a listener that failed
            traceback.print_exc()
        self._add(event)

    def _add(self, event: JobEvent) -> None:
        """Keep `event` for the follower, and wake it."""
        with self._lock:
            self._events.append(event)
            wake = self._wake
        if wake is not None:
            wake()

    async def follow(self, gone: Callable[[], Awaitable[bool]] | None = None, every: float = 0.5
                     ) -> AsyncIterator[JobEvent]:
        """Its events as they come, to one follower at a time, until its Finished or Failed (the last one). Cancels
        the job if `gone()`, asked every `every` seconds while no event comes, says its client left, or if the
        follower is cancelled."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the follower's loop has closed: nobody is left to wake
                pass

        with self._lock:
            if self._wake is not None:
                raise RuntimeError("this job has a follower already")
            self._wake = wake
        checked = time.monotonic()
        try:
            while True:
                arrived.clear()
                with self._lock:
                    event = self._events.popleft() if self._events else None
                if event is not None:
                    yield event
                    if isinstance(event, (Finished, Failed)):
                        return
                    continue
                watched = gone is not None and self.cancelled is None
                if watched and time.monotonic() - checked >= every:
                    checked = time.monotonic()
                    if await gone():
                        self.cancel("the client went away")
                        continue
                try:
                    async with asyncio.timeout(checked + every - time.monotonic() if watched else None):
                        await arrived.wait()
                except TimeoutError:  # time to ask `gone` again
                    pass
        except asyncio.CancelledError:
            self.cancel("cancelled by the client")
            raise
        finally:
            with self._lock:
                self._wake = None


class JobQueue:
    """Owners in turn, each owner's jobs in order; at most `max_waiting` waiting, `per_owner` of one owner's (None:
    no limit of its own); closing it fails everything still waiting."""

    def __init__(self, max_waiting: int, per_owner: int | None = None, on_end: JobCallback | None = None) -> None:
        self.max_waiting = max_waiting
        self.per_owner = per_owner
        self.on_end = on_end
        """Told how each of its jobs ends (in the thread that ends it; app.server.metrics counts them): the one place to
        watch every job's end, whether it ran, failed, was cancelled or never got its turn."""
        self._waiting: list[Job] = []
        """In arrival order (cancelled ones included until their turn)."""
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        """Notified as a job is queued or the queue closes: wakes the idle groups (wait_for_job)."""
        self._closed_because: str | None = None
        self.failed_at_close = 0
        """How many waiting jobs closing it failed: their clients are being told why (app.server.serve waits a moment
        for them before it closes the server)."""
        self._taken: list[Job] = []
        """Jobs taken by a group (the ended ones are dropped as more are taken): what runs, and what a
        SIGTERM that finds the main thread stuck must fail (app.server.serve's abandon)."""
        self._turns: dict[str, int] = {}
        """Owner -> the number of the take that last served it (the least recent first; dropped beyond MAX_OWNERS)."""
        self._takes = 0

    def submit(self, model: str, request: GenerationRequest, when_done: Callable[[], None] | None = None,
               estimate: float | None = None, *, owner: str = "", changed: Callable[..., None] | None = None) -> Job:
        """Queue a validated request (`when_done`, `estimate`, `owner`, `changed`: see Job); raises ServiceClosed
        once the server is stopping, ServiceBusy when `max_waiting` requests, or `per_owner` of `owner`'s, wait."""
        job = Job(model, request, when_done, estimate, self.on_end, owner=owner, changed=changed)
        with self._lock:
            if self._closed_because is not None:
                raise ServiceClosed(self._closed_because)
            wanted = [waiting for waiting in self._waiting if waiting.cancelled is None]
            if len(wanted) >= self.max_waiting:
                raise ServiceBusy(f"the server is busy: its queue is full ({len(wanted)} waiting, "
                                  f"--max-queue {self.max_waiting}); try again in a while", self._retry_after())
            mine = sum(1 for waiting in wanted if waiting.owner == owner)
            if self.per_owner is not None and mine >= self.per_owner:
                raise ServiceBusy(f"you have {mine} requests waiting, this server's most for one client "
                                  f"(--max-queue-per-owner {self.per_owner}); try again once one has started",
                                  self._retry_after())
            self._waiting.append(job)
            self._arrived.notify_all()
        return job

    def _retry_after(self) -> float:
        """Seconds until the first running job should end, by its estimate (RETRY_SECONDS where none has one)."""
        now = time.monotonic()
        left = [max(0.0, job.estimate - (now - job.started_at)) for job in self._taken
                if not job.ended and job.estimate is not None and job.started_at is not None]
        return max(1.0, min(left)) if left else RETRY_SECONDS

    def wait_for_job(self, timeout: float) -> None:
        """Return once a job waits or the queue is closed, or after `timeout` seconds (an idle group's wait)."""
        with self._arrived:
            if not self._waiting and self._closed_because is None:
                self._arrived.wait(timeout)

    def _in_turn(self) -> list[Job]:
        """The wanted waiting jobs in the order they would be taken: the owner served least recently first (one
        never served before all), each owner's jobs in arrival order. Under the lock."""
        lines: dict[str, list[Job]] = {}
        for job in self._waiting:
            if job.cancelled is None:
                lines.setdefault(job.owner, []).append(job)
        # Each job taken makes its owner the most recently served, so after the first round the owners keep their
        # order: one job of each in turn (a tie among the never served goes to the first to arrive: dict order).
        owners = sorted(lines, key=lambda owner: self._turns.get(owner, -1))
        return [job for turn in zip_longest(*(lines[owner] for owner in owners)) for job in turn if job is not None]

    def snapshot(self) -> tuple[list[Job], list[Job]]:
        """The running jobs and the jobs still wanted that wait, in the order of their turns (for the status line)."""
        with self._lock:
            return [job for job in self._taken if not job.ended], self._in_turn()

    def take(self, timeout: float, on_take: Callable[[], None] | None = None) -> Job | None:
        """The next job that is still wanted (now a running one), or None if none arrives within `timeout`
        seconds. Cancelled ones are failed with their reason on the way. `on_take` runs as a job is taken,
        under the queue's lock (so that a job is never seen neither waiting nor taken)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                # one look at each job: a client may cancel one meanwhile (Job.cancel takes no lock)
                kept, dropped = [], []
                for job in self._waiting:
                    (kept if job.cancelled is None else dropped).append(job)
                self._waiting = kept
                turns = self._in_turn()  # empty where the jobs kept were cancelled since: dropped next time
                job = turns[0] if turns else None
                if job is not None:
                    self._waiting.remove(job)
                    self._takes += 1
                    self._turns.pop(job.owner, None)
                    self._turns[job.owner] = self._takes
                    while len(self._turns) > MAX_OWNERS:
                        del self._turns[next(iter(self._turns))]
                    self._taken.append(job)
                    self._taken = [taken for taken in self._taken if not taken.ended]
                    if on_take is not None:
                        on_take()
                elif not dropped:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed_because is not None:
                        return None
                    self._arrived.wait(remaining)
                    continue
            for cancelled in dropped:
                cancelled.fail(cancelled.cancelled)
            if job is not None:
                return job

    def waiting(self) -> int:
        """How many jobs wait (cancelled ones included until their turn comes)."""
        with self._lock:
            return len(self._waiting)

    def running(self) -> list[Job]:
        """The jobs taken and not yet ended, oldest first."""
        with self._lock:
            return [job for job in self._taken if not job.ended]

    @property
    def closed(self) -> str | None:
        """Why the queue takes no more jobs (None: it takes them)."""
        with self._lock:
            return self._closed_because

    def close(self, reason: str) -> None:
        """Refuse new jobs and fail the waiting ones with `reason` (their rows stay queued: see Job.fail)."""
        with self._lock:
            self._closed_because = reason
            waiting, self._waiting = self._waiting, []
            self.failed_at_close += len(waiting)
            self._arrived.notify_all()
        for job in waiting:
            job.fail(reason, record=False)


@dataclass(frozen=True)
class Worker:
    """One group of ranks as the queue sees it: its run (LockstepService.run on rank 0's own group,
    app.ranks.groups.RemoteGroup.run on another), its label ("" when the ranks are one group) and its layout's index."""

    run: Callable[..., Generation]
    label: str = ""
    plan: str = ""
    keep_alive: Callable[[], None] = lambda: None
    """Called while the group is idle: heartbeats, and RankLost where the group is gone."""
    layout: int = 0
    ranks: int = 1
    """How many ranks the group has."""


def layout_workers(runtime: Runtime, index: int) -> list[Worker]:
    """Rank 0: a Worker for each group of layout `index`, its own group's first."""
    layout = runtime.layouts[index]
    own = Worker(run=layout.service.run, label=layout.label(0), plan=layout.plan,
                 keep_alive=layout.service.keep_alive, layout=index, ranks=layout.group_size)
    return [own, *(Worker(run=group.run, label=group.label, plan=layout.plan, keep_alive=group.keep_alive,
                          layout=index, ranks=layout.group_size) for group in layout.remote)]


def choose_layout(waiting: list[Job], groups: list[int], budget: RequestBudget | None) -> int:
    """Which layout (by its number of groups, `groups`; the first has one) serves the `waiting` jobs: one job alone
    runs on every rank as one group (the lowest latency on GPUs); several, on the layout that ends them soonest by
    its estimates of them (the budget's cost models, one per layout) dealt in order to its groups as they free up,
    on a tie the fewer groups. A layout where some job would run over the server's limit is not chosen. Before
    every layout has estimates of them all: the most groups that the waiting jobs can fill.
    """
    if len(waiting) <= 1:
        return 0
    finish: dict[int, float] = {}
    for index, count in enumerate(groups):
        estimates = [budget.estimate(job.model, job.request, index) for job in waiting] if budget else [None]
        if any(estimate is None for estimate in estimates):
            return max((i for i, c in enumerate(groups) if c <= len(waiting)), key=lambda i: groups[i])
        if budget.max_seconds is not None and max(estimates) > budget.max_seconds:
            continue
        ends = [0.0] * count
        for estimate in estimates:
            ends[ends.index(min(ends))] += estimate
        finish[index] = max(ends)
    if not finish:
        return 0
    return min(finish, key=lambda index: (finish[index], groups[index]))


JobCallback = Callable[[Job, "Generation | str"], None]
"""Called in the worker's thread when a job ends: with its Generation, or with why it failed."""


def serve_jobs(runtime: Runtime, jobs: JobQueue, stop: threading.Event, budget: RequestBudget | None, *,
               until_drained: bool = False, on_end: JobCallback | None = None) -> None:
    """Rank 0's main loop: run queued jobs until `stop` is set (or, `until_drained`, until none waits or runs),
    each on the first group free of the layout the ranks are in: rank 0's own (in this thread, which heartbeats it
    while idle) and every other one (a thread each). The caller closes the queue (serve, with closing_reason: as
    late as it can, for a rank's death is seen a moment after its SIGTERM).

    Where the run regroups (`--replicas auto`), whenever every group is idle the layout that ends the waiting jobs
    soonest is chosen (choose_layout) and the ranks move to it (Runtime.regroup): one request alone runs on every
    rank; a queue runs on smaller groups, side by side; once the queue drains the ranks are one group again.

    A running job stops at the next step when its client cancels it or `budget` says it is over the server's
    time limit. A failed or stopped request is reported to its job and the loop goes on; RankLost, in any
    group, ends the loop (and the run).
    """
    groups = [layout.replicas for layout in runtime.layouts]
    choose = (lambda waiting: choose_layout(waiting, groups, budget)) if runtime.regroups else None
    while True:
        target = _serve_layout(layout_workers(runtime, runtime.active), jobs, stop, budget, choose, until_drained,
                               on_end)
        if target is None:
            return
        runtime.regroup(target)


def closing_reason(runtime: Runtime) -> str:
    """What the jobs still waiting are told as the queue closes: that a rank is gone where one is (torchrun's SIGTERM
    after a rank's death can end the loop before any collective finds the dead rank: the request then waiting never
    reached one), else that the server is shutting down."""
    if runtime.service.dead_ranks(wait=0.0):
        return f"the server lost a rank and is ending: {runtime.service.lost_message('SIGTERM came')}"
    return SHUTTING_DOWN


SHUTTING_DOWN = "the server is shutting down"


def _serve_layout(workers: list[Worker], jobs: JobQueue, stop: threading.Event, budget: RequestBudget | None,
                  choose: Callable[[list[Job]], int] | None, until_drained: bool, on_end: JobCallback | None
                  ) -> int | None:
    """serve_jobs in one layout: until it is over (None), or until every group is idle and `choose` wants another
    layout for the jobs waiting (that layout's index)."""
    lost: list[RankLost] = []
    busy: set[int] = set()
    leave: list[int] = []
    lock = threading.Lock()
    """Held while a group takes a job or the layout is judged, so that no job is taken as the ranks regroup."""
    here = workers[0].layout

    def over() -> bool:
        if stop.is_set() or lost or leave:
            return True
        return until_drained and jobs.waiting() == 0 and not busy

    def work(worker: Worker, index: int) -> None:
        while not over():
            with lock:
                if leave:
                    return
                if choose is not None and not busy:
                    target = choose(jobs.snapshot()[1])
                    if target != here:
                        leave.append(target)
                        return
                job = jobs.take(timeout=0, on_take=lambda: busy.add(index))
            try:
                if job is None:
                    worker.keep_alive()
                    jobs.wait_for_job(IDLE_SECONDS)
                    continue
                _run_job(worker, job, budget, on_end)
            except RankLost as error:
                # Not `stop.set()`: a set stop makes the SIGTERM that torchrun sends next a KeyboardInterrupt,
                # which would end this process before its clients hear why. The other groups' requests are
                # cancelled instead (each stops at its next step), and every loop sees `lost`.
                lost.append(error)
                for running in jobs.running():
                    running.cancel(f"the server lost a rank and is ending: {error}")
                return
            finally:
                busy.discard(index)

    threads = [threading.Thread(target=work, args=(worker, index), name=f"group-{index + 1}", daemon=True)
               for index, worker in enumerate(workers[1:], 1)]
    for thread in threads:
        thread.start()
    work(workers[0], 0)
    for thread in threads:
        while thread.is_alive():  # the other groups end their requests (a stop reaches them too)
            thread.join(timeout=POLL_SECONDS)
            if lost:
                break
    if lost:
        raise lost[0]
    return leave[0] if leave and not stop.is_set() else None


def _run_job(worker: Worker, job: Job, budget: RequestBudget | None, on_end: JobCallback | None) -> None:
    """Run one job on `worker`'s group and report its end to the job (and to `on_end`); raises RankLost."""
    job.start(worker.label, worker.plan, worker.ranks)
    decode = budget.decode_estimate(job.model, job.request, worker.layout) if budget is not None else 0.0
    clock = RequestClock(steps=job.request.steps, decode_seconds=decode)

    def should_stop(done: int, total: int) -> str | None:
        if done:
            clock.step()
        if job.cancelled is not None:
            return f"{job.cancelled} (asked after step {job.cancelled_after}, stopped at step {done} of {total})"
        return budget.overrun(clock, done) if budget is not None else None

    try:
        generation = worker.run(job.model, job.request, on_step=job.step, should_stop=should_stop)
    except RankLost as error:
        job.fail(f"the server lost a rank and is ending: {error}")
        raise
    except JobFailed as error:  # JobCancelled too
        if isinstance(error, JobCancelled):
            print(f"{job.model} request stopped{f' on {worker.label}' if worker.label else ''}: {error}",
                  file=sys.stderr, flush=True)
        if on_end is not None:
            on_end(job, str(error))
        job.fail(str(error))
        return
    if budget is not None:
        _record(budget, job.model, job.request, clock, generation, worker.layout)
    if on_end is not None:
        on_end(job, generation)
    job.finish(generation)


def _record(budget: RequestBudget, model: str, request: GenerationRequest, clock: RequestClock,
            generation: Generation, layout: int = 0) -> None:
    """Teach the model's cost model a finished request: its steps after the first (which may include compiling
    the engine for a new size; one step: that one) and its decode."""
    decode = generation.stages.decode if generation.stages is not None else 0.0
    budget.record(model, request, clock.steady_step_seconds() or generation.step_seconds, decode, layout)


def calibrate(service: LockstepService, budget: RequestBudget, model: str, first: GenerationRequest,
              candidates: Iterable[GenerationRequest], most_seconds: float, layout: int = 0) -> list[str]:
    """Seed a model's cost model (in `layout`, whose rank 0's group `service` is) at start-up: run `first` on rank
    0's group, then each of `candidates` whose estimate is under `most_seconds`
    (app.server.budget.calibration_requests); returns one line per request run (what it took, what the model now
    estimates)."""
    lines = []
    for request in [first, *candidates]:
        if request is not first:
            estimate = budget.estimate(model, request, layout)
            if estimate is None or estimate > most_seconds:
                continue
        clock = RequestClock(steps=request.steps)
        started = time.monotonic()
        generation = service.run(model, request, on_step=lambda done, total, clock=clock: clock.step())
        _record(budget, model, request, clock, generation, layout)
        lines.append(f"{request.width}x{request.height}x{request.frames}: {duration(time.monotonic() - started)}"
                     f" (estimated now {duration(budget.estimate(model, request, layout) or 0.0)})")
    return lines

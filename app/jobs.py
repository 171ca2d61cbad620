"""Rank 0's request queue: UI threads submit jobs, the main thread runs them one at a time.

Concurrent users are queued, never interleaved: the lockstep service runs one request on all ranks
at a time, in arrival order. Each job carries its own event stream (Started when its turn comes, step
progress, then a result or a failure) back to the thread that submitted it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator

from app.failures import JobFailed, RankLost
from app.lockstep import Generation, LockstepService
from pipelines.requests import GenerationRequest

POLL_SECONDS = 0.2
"""How often the idle main loop looks at the stop flag and the heartbeat clock."""


class ServiceClosed(RuntimeError):
    """The server is shutting down and takes no more requests."""


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


class Job:
    """One submitted request and the stream of what happens to it."""

    def __init__(self, model: str, request: GenerationRequest) -> None:
        self.model = model
        self.request = request
        self._events: queue.Queue[Started | Step | Finished | Failed] = queue.Queue()

    def start(self) -> None:
        self._events.put(Started())

    def step(self, done: int, total: int) -> None:
        self._events.put(Step(done, total))

    def finish(self, generation: Generation) -> None:
        self._events.put(Finished(generation))

    def fail(self, message: str) -> None:
        self._events.put(Failed(message))

    def events(self) -> Iterator[Started | Step | Finished | Failed]:
        """Started and the steps as they happen, ending with the job's Finished or Failed."""
        while True:
            event = self._events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return


class JobQueue:
    """First come, first served; closing it fails everything still waiting."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._closed_because: str | None = None
        self.current: Job | None = None
        """The job the main loop took last: what a SIGTERM that finds the main thread stuck must fail
        (app.serve's abandon)."""

    def submit(self, model: str, request: GenerationRequest) -> Job:
        """Queue a validated request; raises ServiceClosed once the server is stopping."""
        job = Job(model, request)
        with self._lock:
            if self._closed_because is not None:
                raise ServiceClosed(self._closed_because)
            self._queue.put(job)
        return job

    def take(self, timeout: float) -> Job | None:
        """The next job (now the current one), or None if none arrives within `timeout` seconds."""
        try:
            job = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.current = job
        return job

    def close(self, reason: str) -> None:
        """Refuse new jobs and fail the waiting ones with `reason`."""
        with self._lock:
            self._closed_because = reason
        while True:
            try:
                self._queue.get_nowait().fail(reason)
            except queue.Empty:
                return


def serve_jobs(service: LockstepService, jobs: JobQueue, stop: threading.Event) -> None:
    """Rank 0's main loop: run queued jobs on all ranks until `stop` is set; heartbeat while idle.

    A failed request is reported to its job and the loop goes on; RankLost ends the loop (and the run).
    """
    try:
        while not stop.is_set():
            job = jobs.take(timeout=POLL_SECONDS)
            if job is None:
                service.keep_alive()
                continue
            job.start()
            try:
                generation = service.run(job.model, job.request, on_step=job.step)
            except RankLost as error:
                job.fail(f"the server lost a rank and is ending: {error}")
                raise
            except JobFailed as error:
                job.fail(str(error))
                continue
            job.finish(generation)
    finally:
        jobs.close("the server is shutting down")

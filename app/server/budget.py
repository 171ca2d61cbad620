"""How much time one request may hold a shared server's ranks (`serve --max-request-seconds`).

A step cannot be interrupted once it runs, nor a decode, so the limit is mostly kept up front, by an
estimate of the whole request (its steps and its decode), from a cost model per model:

    seconds = steps x (step overhead + step FLOPs / step rate) + decode overhead + decode FLOPs / decode rate

The FLOPs come from pipelines.work, which counts them on the model's own classes at the request's
shapes: attention's quadratic term and the VAE's are in them, so a size never served is estimated as
well as one served before. The overheads and rates are measured: at start-up by a short calibration
(requests of three steps: the model's default size, then twice its side, each at the fewest frames, and for a video
its default length), and
after that by every request served, fitted by least squares on relative error. On tiny-flux, 2 CPU ranks, fitted
from 256x256 and 512x512 alone, steps from 768x768 to 4096x4096 came out within 0.8x-1.7x of their
measured time, decodes within 0.55x-1.3x.

A request is then held to the limit three times:

1. up front: refused, with its estimate, when the estimate is over the limit;
2. while it runs, by projection: after each step, its elapsed time, its own steps so far and the
   model's decode estimate predict the end; past the limit it is stopped;
3. by the clock: past the limit it is stopped at the next step, whatever the estimates said.

The step time measured skips each request's first step, which may include compiling the engine for a
new size.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipelines.requests import GenerationRequest, RequestError

if TYPE_CHECKING:  # pipelines.work imports torch; the CLI's --help must not
    from pipelines.work import Work

DEFAULT_MAX_REQUEST_SECONDS = 600.0
LIMIT_OPTION = "--max-request-seconds"
MAX_OBSERVATIONS = 64
"""Measurements a rate is fitted from (the latest per amount of work)."""

WorkCount = Callable[[GenerationRequest], "Work"]


class RateFit:
    """seconds = overhead + flops / rate, fitted to measurements (flops, seconds) by least squares on relative
    error, with overhead >= 0 (the overhead is what a step or decode costs besides its arithmetic)."""

    def __init__(self) -> None:
        self._seconds: dict[float, float] = {}
        """FLOPs -> the latest seconds measured for that much work (dict order: oldest first)."""
        self.overhead = 0.0
        self.seconds_per_flop: float | None = None

    def add(self, flops: float, seconds: float) -> None:
        self._seconds.pop(flops, None)
        self._seconds[flops] = seconds
        while len(self._seconds) > MAX_OBSERVATIONS:
            del self._seconds[next(iter(self._seconds))]
        self._fit()

    def __call__(self, flops: float) -> float | None:
        """Seconds for `flops` of work, or None before any measurement."""
        if self.seconds_per_flop is None:
            return None
        return self.overhead + flops * self.seconds_per_flop

    def _fit(self) -> None:
        # Minimise sum(((c + k f) / t - 1)^2): weighted linear least squares in (c, k) with rows (1/t, f/t).
        rows = [(1 / t, f / t) for f, t in self._seconds.items() if f > 0 and t > 0]
        if not rows:
            return
        s11 = sum(a * a for a, _ in rows)
        s12 = sum(a * b for a, b in rows)
        s22 = sum(b * b for _, b in rows)
        y1 = sum(a for a, _ in rows)
        y2 = sum(b for _, b in rows)
        determinant = s11 * s22 - s12 * s12
        if len(rows) >= 2 and determinant > 1e-12 * s11 * s22:
            overhead = (y1 * s22 - y2 * s12) / determinant
            per_flop = (s11 * y2 - s12 * y1) / determinant
            if overhead >= 0 and per_flop > 0:
                self.overhead, self.seconds_per_flop = overhead, per_flop
                return
        # One size measured, or a fit that needs a negative overhead: all of it is arithmetic (k through the origin).
        self.overhead, self.seconds_per_flop = 0.0, y2 / s22


@dataclass
class CostModel:
    """One model's seconds for a request: its steps and its decode (see the module docstring)."""

    step: RateFit = field(default_factory=RateFit)
    decode: RateFit = field(default_factory=RateFit)

    def estimate(self, work: Work, steps: int) -> float | None:
        step, decode = self.step(work.step_flops), self.decode(work.decode_flops)
        if step is None or decode is None:
            return None
        return steps * step + decode


@dataclass
class RequestClock:
    """One running request's clock: its start, its step times, and its decode's estimate."""

    steps: int
    started: float = field(default_factory=time.monotonic)
    step_ends: list[float] = field(default_factory=list)
    decode_seconds: float = 0.0
    """What its decode is expected to take (the cost model's estimate; 0 when there is none)."""

    def step(self, now: float | None = None) -> None:
        self.step_ends.append(time.monotonic() if now is None else now)

    def steady_step_seconds(self) -> float | None:
        """Mean time of its steps after the first, once it has taken two."""
        if len(self.step_ends) < 2:
            return None
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)


EARLY_STOP_MARGIN = 1.25
"""A running request is stopped before the limit only when its projection is this far over it: the projection comes
from its first steps, which a loaded machine can slow by a few tens of percent; one projected closer to the limit runs
on and is stopped at the limit itself if it gets there."""


class RequestBudget:
    """The server's limit on one request's time, and the cost model of each model it serves.

    Used by rank 0's threads: the UI checks requests (check), the main loop records finished ones
    (record) and asks about running ones (overrun).
    """

    def __init__(self, max_seconds: float | None, work_counts: dict[str, WorkCount], layouts: int = 1) -> None:
        self.max_seconds = max_seconds
        self._work = dict(work_counts)
        # One cost model per model and layout (app.ranks.groups.Layout: how the ranks form groups), for a group of each
        # layout runs at its own speed. Layout 0 is the one a request is checked against: every rank as one group
        # where the run may regroup (the fastest for one request), else the run's only layout.
        self._models = {(key, layout): CostModel() for key in work_counts for layout in range(layouts)}
        self._lock = threading.Lock()

    def work(self, key: str, request: GenerationRequest) -> Work:
        return self._work[key](request)

    def estimate(self, key: str, request: GenerationRequest, layout: int = 0) -> float | None:
        """Seconds `request` should hold a group of `layout` on model `key` (steps and decode), or None before any
        measurement of the model there."""
        work = self.work(key, request)
        with self._lock:
            return self._models[key, layout].estimate(work, request.steps)

    def decode_estimate(self, key: str, request: GenerationRequest, layout: int = 0) -> float:
        """Seconds the request's decode should take (0 before any measurement)."""
        work = self.work(key, request)
        with self._lock:
            return self._models[key, layout].decode(work.decode_flops) or 0.0

    def check(self, key: str, request: GenerationRequest) -> float | None:
        """The request's estimate; RequestError if it is over the limit (call before queueing)."""
        estimate = self.estimate(key, request)
        if self.max_seconds is not None and estimate is not None and estimate > self.max_seconds:
            frames = f", {request.frames} frames" if request.frames > 1 else ""
            raise RequestError(
                f"this request would take about {duration(estimate)} ({request.steps} step"
                f"{'s' if request.steps > 1 else ''} at {request.width}x{request.height}{frames}, and its decode); "
                f"this server's limit is {duration(self.max_seconds)} a request ({LIMIT_OPTION}): ask for fewer "
                "steps or a smaller size")
        return estimate

    def record(self, key: str, request: GenerationRequest, step_seconds: float, decode_seconds: float,
               layout: int = 0) -> None:
        """A finished request's steady step time and decode time (on a group of `layout`): the model's cost model
        there learns from them."""
        work = self.work(key, request)
        with self._lock:
            model = self._models[key, layout]
            model.step.add(work.step_flops, step_seconds)
            model.decode.add(work.decode_flops, decode_seconds)

    def overrun(self, clock: RequestClock, done: int, now: float | None = None) -> str | None:
        """Why a running request must stop now (over the limit, or certain to be), or None."""
        if self.max_seconds is None:
            return None
        now = time.monotonic() if now is None else now
        elapsed = now - clock.started
        where = f"at step {done} of {clock.steps}"
        if elapsed > self.max_seconds:
            return (f"stopped {where} after {duration(elapsed)}: this server's limit is "
                    f"{duration(self.max_seconds)} a request ({LIMIT_OPTION})")
        step = clock.steady_step_seconds()
        if step is not None and done < clock.steps:
            projected = elapsed + (clock.steps - done) * step + clock.decode_seconds
            if projected > self.max_seconds * EARLY_STOP_MARGIN:
                return (f"stopped {where}: at {duration(step)} a step it would take about {duration(projected)}, "
                        f"and this server's limit is {duration(self.max_seconds)} a request ({LIMIT_OPTION}): "
                        "ask for fewer steps or a smaller size")
        return None


CALIBRATION_SECONDS = 10.0
"""The most a second calibration request may be estimated to take (from the first one's measurement)."""


def calibration_requests(default: GenerationRequest, *, min_frames: int, max_height: int, max_width: int,
                         multiple: int) -> tuple[GenerationRequest, list[GenerationRequest]]:
    """The requests that seed a model's cost model, three steps each (the last two are the steady ones, each
    measured twice, for one step alone is a noisy measure on a loaded machine): first the model's default size at
    its fewest frames (a video's default length can cost minutes), then those of the candidates whose estimate, from
    the measurements before, is under CALIBRATION_SECONDS: twice the side (within the model's limits), then, for a
    video, its default length (so that frames, not only sides, are measured)."""
    def larger(side: int, maximum: int) -> int:
        return max(multiple, min(2 * side, maximum) // multiple * multiple)

    first = replace(default, steps=3, frames=min_frames if default.frames > 1 else 1)
    candidates = [replace(first, height=larger(first.height, max_height), width=larger(first.width, max_width)),
                  replace(first, frames=default.frames)]
    return first, [request for request in candidates if request != first]


def counted_work(count: WorkCount, name: str) -> WorkCount:
    """`count`, or where it cannot count a model's FLOPs (a family without an input builder), pixels and their
    square as a rough stand-in, said once on stderr."""
    failed: list[str] = []

    def work(request: GenerationRequest) -> Work:
        from pipelines.work import Work

        if not failed:
            try:
                return count(request)
            except Exception as error:  # an estimate is worth having without its FLOPs
                failed.append(str(error))
                print(f"warning: cannot count {name}'s FLOPs ({error}); its time estimates scale with pixels",
                      file=sys.stderr, flush=True)
        pixels = float(request.height * request.width * request.frames)
        return Work(step_flops=pixels + pixels * pixels / 1e6, decode_flops=pixels)

    return work


def duration(seconds: float) -> str:
    """`seconds` as messages and the status line say it: 0.42 s, 8.5 s, 75 s, 12 min."""
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"

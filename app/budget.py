"""How much work one request may ask of a shared server (`serve --max-request-seconds`).

A request is held to the limit three times:

1. up front, by an estimate: its steps x the step time this server measured for the model, scaled by
   the work of one step. A transformer step costs about L x (24 n d^2 + 4 n^2 d) for n tokens of
   width d (the projections and MLP, then attention's two n x n products), so step_work(n) =
   n (6d + n) up to a constant factor per model, and the measured seconds per unit of that work
   predict other sizes. Before the model's first request there is no measurement, and no estimate;
2. while it runs, by projection: from its second step on, its own steps so far predict the rest;
3. by the clock: past the limit it is stopped at the next step, whatever the estimates said.

Steps and sizes are the request's; encoding and decoding are not counted (a small share next to the
denoising steps). The step time measured skips each request's first step, which may include
compiling the engine for a new size.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.registry import ModelSpec, read_component_config
from pipelines.requests import GenerationRequest, MediaLimits, RequestError, uses_guidance_batch

DEFAULT_MAX_REQUEST_SECONDS = 600.0
LIMIT_OPTION = "--max-request-seconds"


@dataclass(frozen=True, kw_only=True)
class WorkModel:
    """What one denoising step of a model costs, in the units of step_work."""

    spec: ModelSpec
    limits: MediaLimits
    width: int
    """The transformer's hidden width d (attention heads x head size)."""

    @classmethod
    def of(cls, spec: ModelSpec, folder: Path, limits: MediaLimits) -> WorkModel:
        config = read_component_config(folder, "transformer")
        return cls(spec=spec, limits=limits, width=config["num_attention_heads"] * config["attention_head_dim"])

    def tokens(self, request: GenerationRequest) -> int:
        """The transformer's tokens per step: latent patches of every latent frame, twice for models that
        batch classifier-free guidance's two branches when guidance is on."""
        per_frame = (request.height // self.limits.size_multiple) * (request.width // self.limits.size_multiple)
        latent_frames = 1 + (request.frames - 1) // self.limits.frame_multiple
        branches = 2 if uses_guidance_batch(self.spec) and request.guidance > 1.0 else 1
        return per_frame * latent_frames * branches

    def step_work(self, request: GenerationRequest) -> float:
        n = self.tokens(request)
        return n * (6 * self.width + n)


@dataclass
class RequestClock:
    """One running request's clock: its start and its step times."""

    steps: int
    started: float = field(default_factory=time.monotonic)
    step_ends: list[float] = field(default_factory=list)

    def step(self, now: float | None = None) -> None:
        self.step_ends.append(time.monotonic() if now is None else now)

    def steady_step_seconds(self) -> float | None:
        """Mean time of its steps after the first, once it has taken two."""
        if len(self.step_ends) < 2:
            return None
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)


class RequestBudget:
    """The server's limit on one request's denoising time, and what it has measured per model.

    Used by rank 0's threads: the UI checks requests (check), the main loop records finished ones
    (record) and asks about running ones (overrun).
    """

    def __init__(self, max_seconds: float | None, models: dict[str, WorkModel]) -> None:
        self.max_seconds = max_seconds
        self._models = dict(models)
        self._seconds_per_work: dict[str, float] = {}
        self._lock = threading.Lock()

    def estimate(self, key: str, request: GenerationRequest) -> float | None:
        """Seconds of denoising `request` on model `key` should take, or None before a measurement."""
        with self._lock:
            rate = self._seconds_per_work.get(key)
        if rate is None:
            return None
        return request.steps * rate * self._models[key].step_work(request)

    def check(self, key: str, request: GenerationRequest) -> None:
        """RequestError if `request`'s estimate is over the limit (before it is queued)."""
        if self.max_seconds is None:
            return
        estimate = self.estimate(key, request)
        if estimate is not None and estimate > self.max_seconds:
            step = estimate / request.steps
            raise RequestError(
                f"this request would take about {_duration(estimate)} ({request.steps} steps of about "
                f"{_duration(step)} at {request.width}x{request.height}"
                f"{f', {request.frames} frames' if request.frames > 1 else ''}); this server's limit is "
                f"{_duration(self.max_seconds)} a request ({LIMIT_OPTION}): ask for fewer steps or a smaller size")

    def record(self, key: str, request: GenerationRequest, steady_step_seconds: float) -> None:
        """A finished request's step time: the model's measurement from now on."""
        with self._lock:
            self._seconds_per_work[key] = steady_step_seconds / self._models[key].step_work(request)

    def overrun(self, clock: RequestClock, done: int, now: float | None = None) -> str | None:
        """Why a running request must stop now (over the limit, or certain to be), or None."""
        if self.max_seconds is None:
            return None
        now = time.monotonic() if now is None else now
        elapsed = now - clock.started
        where = f"at step {done} of {clock.steps}"
        if elapsed > self.max_seconds:
            return (f"stopped {where} after {_duration(elapsed)}: this server's limit is "
                    f"{_duration(self.max_seconds)} a request ({LIMIT_OPTION})")
        step = clock.steady_step_seconds()
        if step is not None and done < clock.steps:
            projected = elapsed + (clock.steps - done) * step
            if projected > self.max_seconds:
                return (f"stopped {where}: at {_duration(step)} a step it would take about {_duration(projected)}, "
                        f"and this server's limit is {_duration(self.max_seconds)} a request ({LIMIT_OPTION}): "
                        "ask for fewer steps or a smaller size")
        return None


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"

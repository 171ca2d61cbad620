"""How much work one request may ask of a shared server (`serve --max-request-seconds`).

A request is held to the limit three times:

1. up front, by an estimate: its steps x a step time this server measured for the model, from the
   measured size nearest to the request's in tokens, scaled in proportion to tokens. That is exact
   for a size served before; across sizes, per-step overheads grow slower than tokens and attention
   faster (tiny-flux on 2 CPU ranks, each from the size before it: 512x512 estimated at 0.29 s a
   step, measured 0.16; 1024x1024 0.62 s, measured 0.95; 2048x2048 3.8 s, measured 10.6). Before
   the model's first request there is no estimate;
2. while it runs, by projection: from its second step on, its own steps so far predict the rest;
3. by the clock: past the limit it is stopped at the next step, whatever the estimates said.

Only the denoising steps count (encoding and decoding are a small share next to them). The step time
measured skips each request's first step, which may include compiling the engine for a new size.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from pipelines.registry import ModelSpec
from pipelines.requests import GenerationRequest, MediaLimits, RequestError, uses_guidance_batch

DEFAULT_MAX_REQUEST_SECONDS = 600.0
LIMIT_OPTION = "--max-request-seconds"


@dataclass(frozen=True, kw_only=True)
class TokenCount:
    """How many tokens one transformer call of a model processes for a request."""

    spec: ModelSpec
    limits: MediaLimits

    def __call__(self, request: GenerationRequest) -> int:
        """Latent patches of every latent frame, twice for models that batch classifier-free guidance's two
        branches when guidance is on."""
        per_frame = (request.height // self.limits.size_multiple) * (request.width // self.limits.size_multiple)
        latent_frames = 1 + (request.frames - 1) // self.limits.frame_multiple
        branches = 2 if uses_guidance_batch(self.spec) and request.guidance > 1.0 else 1
        return per_frame * latent_frames * branches


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
    """The server's limit on one request's denoising time, and the step times it measured per model.

    Used by rank 0's threads: the UI checks requests (check), the main loop records finished ones
    (record) and asks about running ones (overrun).
    """

    def __init__(self, max_seconds: float | None, token_counts: dict[str, TokenCount]) -> None:
        self.max_seconds = max_seconds
        self._tokens = dict(token_counts)
        self._step_seconds: dict[str, dict[int, float]] = {key: {} for key in token_counts}
        """Model key -> tokens -> the latest steady step time measured at that many tokens."""
        self._lock = threading.Lock()

    def estimate(self, key: str, request: GenerationRequest) -> float | None:
        """Seconds of denoising `request` on model `key` should take, or None before a measurement."""
        tokens = self._tokens[key](request)
        with self._lock:
            measured = dict(self._step_seconds[key])
        if not measured:
            return None
        nearest = min(measured, key=lambda count: abs(math.log(count / tokens)))
        return request.steps * measured[nearest] * tokens / nearest

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
        """A finished request's step time: the model's measurement at its token count from now on."""
        with self._lock:
            self._step_seconds[key][self._tokens[key](request)] = steady_step_seconds

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

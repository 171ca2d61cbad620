"""Where a request's time went: its stages (encode, each denoising step, decode, write) in seconds.

Rank 0's lockstep service measures encode, steps and decode (app.ranks.lockstep); whoever writes the file adds
the write. The UI's status line, the batch manifest and the benchmark's JSON show the same record.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class StageSeconds:
    """Wall seconds of one request's stages, as rank 0 saw them."""

    encode: float
    """Text (and input) encoding on rank 0, handing the encoding to every rank, and the part of it every rank
    runs (a split input encode)."""
    steps: tuple[float, ...]
    """Each denoising step, its agreement point included (on GPUs: CUDA events between step ends)."""
    decode: float
    """VAE decode (split over the ranks or on rank 0) and the ranks' last meeting."""
    write: float | None = None
    """Writing the result file; None until it is written."""

    def with_write(self, seconds: float) -> StageSeconds:
        return replace(self, write=seconds)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (batch manifest, benchmark rows)."""
        return {"encode_s": round(self.encode, 4), "step_s": [round(s, 4) for s in self.steps],
                "decode_s": round(self.decode, 4), "write_s": None if self.write is None else round(self.write, 4)}

    def describe(self) -> str:
        """One line: 'encode 0.12 s · 8 steps 1.60 s (200 ms/step) · decode 0.30 s · write 0.05 s'."""
        total = sum(self.steps)
        mean = total / len(self.steps) if self.steps else 0.0
        parts = [f"encode {self.encode:.2f} s",
                 f"{len(self.steps)} step{'s' if len(self.steps) != 1 else ''} {total:.2f} s "
                 f"({mean * 1000:.0f} ms/step)",
                 f"decode {self.decode:.2f} s"]
        if self.write is not None:
            parts.append(f"write {self.write:.2f} s")
        return " · ".join(parts)


@dataclass(frozen=True, kw_only=True)
class RequestTimes:
    """What the status line says of a finished client request."""

    step_seconds: float
    """Its mean step time."""
    stages: StageSeconds | None = None
    """Its stage seconds, its write included (None where they were not measured)."""
    computed_steps: tuple[int, int] | None = None
    """Run with a step cache: (steps computed, steps)."""


class LastRequest:
    """The times of the last client request that finished (set by one thread, read by others). The start-up
    calibration's requests (app.server.serve) never count: before the first client request it holds None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: RequestTimes | None = None

    def set(self, value: RequestTimes) -> None:
        with self._lock:
            self._value = value

    def get(self) -> RequestTimes | None:
        with self._lock:
            return self._value

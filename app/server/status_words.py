"""The status line's plain words: how many GPUs or CPU processes run the models, how they share the work and at
what precision, e.g. "2 GPUs (NVIDIA H200), each with half of every image, half precision (bfloat16)".

The technical names (plan labels such as "cfg-2xulysses-2, all-to-all nccl", the backend) stay beside them, in
the status line's smaller part (app.ranks.runtime.Runtime.describe).
"""

from __future__ import annotations

import re

PRECISIONS = {"float32": "full precision (float32)", "bfloat16": "half precision (bfloat16)",
              "float16": "half precision (float16)"}
FRACTIONS = {2: "half", 3: "a third", 4: "a quarter"}
_DEGREE = re.compile(r"(?:^|x)(cfg|ulysses|ring|allgather|tp)-(\d+)")
"""An axis of a plan label and its degree ("cfg-2xulysses-2" has two)."""


def processes(count: int, device_type: str, device_name: str | None = None) -> str:
    """E.g. "2 GPUs (NVIDIA H200)", "1 CPU process"."""
    if device_type == "cuda":
        return f"{count} GPU{'s' if count != 1 else ''}" + (f" ({device_name})" if device_name else "")
    if device_type == "cpu":
        return f"{count} CPU process{'es' if count != 1 else ''}"
    return f"{count} {device_type} device{'s' if count != 1 else ''}"


def fraction(parts: int) -> str:
    return FRACTIONS.get(parts, f"1/{parts}")


def sharing(plan: str, media: str = "image") -> str:
    """How a group's ranks share each request, from its plan label (engines.parallel.plan.ParallelPlan.label, with or
    without its transport), e.g. "each with half of every image"; "" for one rank. `media`: what a request makes
    ("image", "video", "image or video")."""
    degrees: dict[str, int] = {}
    for axis, degree in _DEGREE.findall(plan.split(" / ")[0].split(",")[0]):
        degrees[axis] = degrees.get(axis, 1) * int(degree)
    sequence = degrees.get("ulysses", 1) * degrees.get("ring", 1) * degrees.get("allgather", 1)
    parts = []
    if sequence > 1:
        parts.append(f"each with {fraction(sequence)} of every {media}")
    if degrees.get("cfg", 1) > 1:
        parts.append("the guided and unguided passes side by side")
    if degrees.get("tp", 1) > 1:
        parts.append(f"each holding {fraction(degrees['tp'])} of the model's weights")
    return ", ".join(parts)


def precision(backend: str) -> str:
    """The precision named in a backend label ('gloo, cpu, float32, eager', app.ranks.runtime.Runtime.backend) in plain
    words, e.g. "full precision (float32)", "half precision (bfloat16) with FP8 weights and int8 attention"; "" if
    it names none."""
    for part in backend.split(", "):
        name, *extras = part.split(" + ")
        if name in PRECISIONS:
            added = [{"fp8": "FP8 weights"}.get(extra, extra) for extra in extras]
            return PRECISIONS[name] + (f" with {' and '.join(added)}" if added else "")
    return ""

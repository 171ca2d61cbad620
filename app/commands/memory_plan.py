"""The tensor-parallel degree a launch runs with: the smallest whose weights fit the GPUs' memory.

Counted before any rank starts, without reading weights (pipelines/memory.py): per rank, the
transformer's share at a tp degree plus, on rank 0 (the fullest), the text encoders and VAE that stay
on its GPU, at 2 bytes a parameter (the GPUs' bfloat16); with --fp8, the transformer's block linears at
1 byte an element plus a float32 scale per output row, what stays resident, so tp is chosen for the FP8
weights. (A rank still loads its share in bfloat16 and quantizes it on the GPU: until loading quantizes
on the host, a degree chosen for FP8 alone may not leave room for that moment; docs/tensor-parallel.md.)
Weights may take WEIGHTS_SHARE of a GPU's memory; the rest is for activations, workspaces and the CUDA
context. The GPUs' memory is the least free memory of the visible GPUs (torch.cuda.mem_get_info), or
`launch --gpu-memory GIB`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipelines.memory import (
    BF16_BYTES,
    GIB,
    WEIGHTS_SHARE,
    rank0_gpu_parameters,
    safetensors_parameters,
    spec_transformer_config,
    transformer_bytes,
)
from pipelines.registry import ModelSpec, family_of


def size(count: int) -> str:
    """Bytes as GiB, or as MiB below one GiB (the tiny models)."""
    return f"{count / GIB:.1f} GiB" if count >= GIB else f"{count / 1024**2:.1f} MiB"


class MemoryPlanError(ValueError):
    """No tensor-parallel degree fits the models on these GPUs (said before loading)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """The chosen degree and what it leaves on the fullest rank."""

    tp: int
    rank_bytes: int
    """Weights on rank 0 (transformer share, text encoders and VAE on its GPU)."""
    gpu_bytes: int
    fp8: bool = False
    """The transformers' block linears counted as FP8 (--fp8)."""

    def describe(self) -> str:
        weights = "weights (FP8 block linears)" if self.fp8 else "weights"
        return (f"--tp {self.tp}: {size(self.rank_bytes)} of {weights} on the fullest rank, within "
                f"{WEIGHTS_SHARE:.0%} of {size(self.gpu_bytes)} per GPU")


def rank_bytes(models: list[tuple[ModelSpec, Path | None]], tp: int, *, fp8: bool = False) -> int:
    """Bytes of weights rank 0 holds running `models` with `tp` (a checkpoint served under two names
    counts once), the transformers' block linears in FP8 with `fp8`; ValueError when tp does not split one
    of them."""
    total = 0
    for spec, folder in {(folder or spec.name): (spec, folder) for spec, folder in models}.values():
        stored = _stored_transformer_parameters(folder) if tp == 1 and not fp8 else None
        if stored is not None:  # nothing split, nothing quantized: what the folder holds, from its headers
            total += stored * BF16_BYTES * spec.experts
        else:
            config = spec_transformer_config(spec, folder)
            total += transformer_bytes(family_of(spec), config, tp, fp8=fp8) * spec.experts  # each expert resident
        total += rank0_gpu_parameters(spec, folder) * BF16_BYTES
    return total


def _stored_transformer_parameters(folder: Path | None) -> int | None:
    """The parameters of the transformer weights in `folder` (safetensors headers), None where it has none.

    At tp 1 without FP8 a rank holds the whole transformer, so its size is what the folder stores: read in
    milliseconds, where building the model on the meta device imports diffusers and transformers first (8 s of
    the launcher's 8.3 s on a 2-core CPU, measured, and more on a GPU host), before any rank may start."""
    if folder is None or not any((Path(folder) / "transformer").glob("*.safetensors")):
        return None
    return safetensors_parameters(Path(folder) / "transformer")


def choose_tp(models: list[tuple[ModelSpec, Path | None]], *, nproc: int, gpu_bytes: int,
              requested: int | None = None, groups: int = 1, fp8: bool = False) -> MemoryPlan:
    """The smallest tp degree (dividing `nproc` into a multiple of `groups` tp groups, 2 with --cfg-parallel,
    and splitting every model) whose weights fit `gpu_bytes` per GPU, or `requested` if it fits, counting
    the transformers' block linears as FP8 with `fp8`; MemoryPlanError naming the memory needed otherwise."""
    degrees = [requested] if requested else [tp for tp in range(1, nproc + 1)
                                             if nproc % tp == 0 and (nproc // tp) % groups == 0]
    budget = int(gpu_bytes * WEIGHTS_SHARE)
    tried = []
    for tp in degrees:
        try:
            need = rank_bytes(models, tp, fp8=fp8)
        except ValueError as error:
            if requested:
                raise MemoryPlanError(f"--tp {tp}: {error}") from None
            continue
        if need <= budget:
            return MemoryPlan(tp=tp, rank_bytes=need, gpu_bytes=gpu_bytes, fp8=fp8)
        tried.append((tp, need))
    if not tried:
        raise MemoryPlanError(f"no tp degree dividing the {nproc} ranks splits the model's heads")
    tp, need = tried[-1]
    names = ", ".join(dict.fromkeys(spec.name for spec, _ in models))
    raise MemoryPlanError(
        f"{names} does not fit {nproc} GPU{'s' if nproc > 1 else ''} of {size(gpu_bytes)}: at --tp {tp} "
        f"rank 0 needs {size(need)} of weights{' (FP8 block linears)' if fp8 else ''}, more than the "
        f"{size(budget)} ({WEIGHTS_SHARE:.0%}) they may take; use more or larger GPUs"
        + ("" if requested is None else " or a larger --tp"))


def gpu_memory() -> int | None:
    """The least free memory of the visible GPUs (CUDA_VISIBLE_DEVICES), in bytes; None without a GPU.

    Read from the driver by nvidia-smi (0.1 s, no CUDA context); where there is none, asked in a short child
    process: torch.cuda.mem_get_info creates a CUDA context on every GPU it asks about (hundreds of MiB each, and
    seconds before any rank starts), and the launcher lives as long as its ranks."""
    import subprocess
    import sys

    free = visible_gpu_free_bytes()
    if free is not None:
        return min(free) if free else None
    script = ("import torch\n"
              "if torch.cuda.is_available():\n"
              "    print(min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())))\n")
    answer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    return int(answer.stdout) if answer.returncode == 0 and answer.stdout.strip() else None


def visible_gpu_free_bytes() -> list[int] | None:
    """Free memory of each GPU that CUDA_VISIBLE_DEVICES leaves visible, from nvidia-smi; None where nvidia-smi
    cannot tell (not installed, no driver, a visible-devices entry it does not know)."""
    import os
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    command = ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"]
    if visible is not None:
        devices = [device.strip() for device in visible.split(",") if device.strip()]
        if not devices or devices[0] == "-1":
            return []
        command.append(f"--id={','.join(devices)}")
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if answer.returncode != 0:
        return None
    try:
        return [int(line) * 2**20 for line in answer.stdout.split()]
    except ValueError:
        return None


def visible_gpus() -> int:
    """How many GPUs the ranks will see: the driver's count (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES) where
    torch is a CUDA build, else torch's own answer. Read without importing torch where nvidia-smi answers: the
    import takes seconds, and every one of them comes before the first rank starts."""
    if _torch_is_cpu_build():
        return 0
    free = visible_gpu_free_bytes()
    if free is not None:
        return len(free)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torch_is_cpu_build() -> bool:
    """Whether the installed torch is a CPU-only build (its version's local part, e.g. 2.13.0+cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return True

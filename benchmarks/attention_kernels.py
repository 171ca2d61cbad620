"""Benchmark: the attention kernels alone, at the shapes one GPU attends in our plans, and their error.

    python -m benchmarks.attention_kernels --out kernels.json             # on a GPU
    python -m benchmarks.attention_kernels --shapes "flux-1024 1 GPU" --kernels "sdpa bf16,ours fp8 (compiled)"
    python -m benchmarks.attention_kernels --sweep --shapes "wan14b-720p 2 GPUs"   # the Triton kernel's settings

For each shape (one GPU's share of a real model's attention: FLUX.1-dev at 1024² on 1, 2 and 4 GPUs' Ulysses
heads; Wan 2.1 14B at 81x720x1280 and 81x480x832 likewise) and each kernel: the median seconds of a call (CUDA
events after 3 warm-up calls, benchmarks.fp8_block.median_ms), its rate in TFLOP/s (4·B·H·N²·D floating-point
operations a call, the same count for every kernel) and its error against float32 attention on the same inputs
(relative norm of the output, the largest LSE difference where the kernel returns one), measured on the first
ERROR_HEADS heads.

Kernels: PyTorch's scaled_dot_product_attention in bf16 as it dispatches (flash) and with cuDNN's; ours
(engines/levers/quantized_attention.py), the whole call (smoothing and quantization included) compiled as the engines
compile it: int8 (our Triton kernel; also alone, on inputs quantized beforehand) and fp8 (FlashAttention-3's FP8
forward where fa3-fwd is installed on a Hopper GPU, else our PyTorch reference, on the shapes of FLUX alone);
SageAttention 1.0.6's Triton kernel (`sageattn`, the registry's) and FlashAttention-3's bf16 forward (the
registry's fa3-fwd 0.0.3 build; its FP8 forward is ours' fp8 row), where they are installed. Inputs are random:
q and v standard normal, k standard normal plus a per-channel offset of 3 standard deviations (the outlier
smoothing removes), bf16.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.fp8_block import median_ms

ERROR_HEADS = 2
"""Heads on which each kernel's error is measured (float32 attention over 75,600 tokens is slow)."""


@dataclass(frozen=True)
class Shape:
    label: str
    heads: int
    tokens: int
    head_dim: int = 128


SHAPES = {shape.label: shape for shape in (
    Shape("flux-1024 1 GPU", 24, 4096 + 512),
    Shape("flux-1024 2 GPUs", 12, 4096 + 512),
    Shape("flux-1024 4 GPUs", 6, 4096 + 512),
    Shape("wan14b-720p 1 GPU", 40, 21 * 45 * 80),
    Shape("wan14b-720p 2 GPUs", 20, 21 * 45 * 80),
    Shape("wan14b-720p 4 GPUs", 10, 21 * 45 * 80),
    Shape("wan14b-480p 1 GPU", 40, 21 * 30 * 52),
)}


def inputs(shape: Shape, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=device).manual_seed(seed)
    size = (1, shape.heads, shape.tokens, shape.head_dim)
    q, k, v = (torch.randn(size, device=device, generator=generator) for _ in range(3))
    k += 3 * torch.randn(1, shape.heads, 1, shape.head_dim, device=device, generator=generator)
    return tuple(t.bfloat16() for t in (q, k, v))


def float_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention and its LSE (natural log), by rows of queries (an N x N float32 matrix is never whole)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    outs, lses = [], []
    for start in range(0, q.shape[2], 2048):
        scores = qf[:, :, start:start + 2048] @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
        lse = scores.logsumexp(dim=-1, keepdim=True)
        outs.append(torch.exp(scores - lse) @ vf)
        lses.append(lse.squeeze(-1))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def kernels(small: bool) -> dict[str, Callable[..., Any]]:
    """Name -> a call of (q, k, v) BHSD bf16 returning the output, or (output, LSE)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from engines.levers.quantized_attention import attention_precision, fa3_forward, quantized_attention_with_lse

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    compiled = torch.compile(quantized_attention_with_lse, fullgraph=True)

    def ours(precision: str) -> Callable[..., Any]:
        def call(q, k, v):
            with attention_precision(precision):  # finds FlashAttention-3 for fp8 where it runs
                return compiled(q, k, v, precision)
        return call

    found: dict[str, Callable[..., Any]] = {"sdpa bf16": sdpa, "sdpa cudnn bf16": cudnn,
                                            "ours int8 (compiled)": ours("int8")}
    found["ours int8 kernel alone"] = KernelAlone()
    if small or fa3_forward() is not None:  # the PyTorch reference is too slow for a video's tokens
        found["ours fp8 (compiled)"] = ours("fp8")
    if fa3_forward() is not None:
        found["fa3 fp8 kernel alone"] = Fa3Fp8Alone(fa3_forward())
    try:
        from fa3_fwd_interface import flash_attn_func

        found["fa3 bf16"] = lambda q, k, v: flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    except Exception as exc:  # not installed, or its build does not load on this torch: said in the output
        print(f"[attention] FlashAttention-3 not measured: {exc!r}"[:300], file=sys.stderr)
    try:
        from sageattention import sageattn

        found["sageattention 1.0.6"] = lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except Exception as exc:  # not installed, or it does not import on this torch/Triton: said in the output
        print(f"[attention] sageattention not measured: {exc!r}"[:300], file=sys.stderr)
    return found


class KernelAlone:
    """engines/levers/quantized_attention_triton.py's int8_attention on inputs quantized once (the call times the kernel
    alone; its error is the whole method's but for the smoothing's LSE correction, so only its output is compared):
    K in blocks of `k_block` tokens (a tile of the kernel's key loop), P·V in FP16 or, `pv_fp8`, in FP8 with V
    scaled per channel; `warps` and `stages` the launch's (default the module's)."""

    def __init__(self, k_block: int | None = None, pv_fp8: bool = False, warps: int | None = None,
                 stages: int | None = None) -> None:
        from engines.levers.quantized_attention import K_BLOCK

        self.k_block, self.pv_fp8, self.warps, self.stages = k_block or K_BLOCK, pv_fp8, warps, stages
        self.prepared: tuple[int, tuple[torch.Tensor, ...]] | None = None

    def __call__(self, q, k, v):
        import engines.levers.quantized_attention_triton as triton_kernel
        from engines.levers.quantized_attention import FP8_MAX, Q_BLOCK, _int8_blocks

        if self.prepared is None or self.prepared[0] != id(q):
            kf = k.float() - k.float().mean(dim=2, keepdim=True)
            if self.pv_fp8:
                v_scale = v.float().abs().amax(dim=2) / FP8_MAX
                v_in = (v.float() / v_scale[:, :, None]).to(torch.float8_e4m3fn)
            else:
                v_scale, v_in = None, v.half()
            self.prepared = (id(q), (*_int8_blocks(q.float(), Q_BLOCK), *_int8_blocks(kf, self.k_block), v_in,
                                     Q_BLOCK, self.k_block, q.dtype, v_scale))
        before = triton_kernel.NUM_WARPS, triton_kernel.NUM_STAGES
        triton_kernel.NUM_WARPS = self.warps or before[0]
        triton_kernel.NUM_STAGES = self.stages or before[1]
        try:
            return triton_kernel.int8_attention(*self.prepared[1])[0]
        finally:
            triton_kernel.NUM_WARPS, triton_kernel.NUM_STAGES = before


class Fa3Fp8Alone:
    """FlashAttention-3's FP8 forward on inputs smoothed and quantized once as `--attention-precision fp8` quantizes
    them (engines.levers.quantized_attention._fa3_fp8): the call times the kernel alone, so that the compiled call's
    row less this one is what the smoothing and quantization cost."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward
        self.prepared: tuple[int, list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, q, k, v):
        from engines.levers.quantized_attention import fa3_fp8_inputs, smoothed

        if self.prepared is None or self.prepared[0] != id(q):
            qf, kf, vf, correction = smoothed(q, k, v)
            self.prepared = (id(q), *fa3_fp8_inputs(qf, kf, vf), correction)
        _, stored, descales, correction = self.prepared
        out, lse = self.forward(*stored, **descales)[:2]
        return out.transpose(1, 2), lse + correction


def sweep() -> dict[str, Callable[..., Any]]:
    """The Triton kernel's launch settings: key tile (and K's quantization block) 64 or 128, 4 or 8 warps, 2 to 4
    stages, P·V in FP16 or FP8."""
    return {f"int8 k{k_block} w{warps} s{stages} pv-{'fp8' if fp8 else 'fp16'}": KernelAlone(k_block, fp8, warps,
                                                                                             stages)
            for k_block in (64, 128) for warps in (4, 8) for stages in (2, 3, 4) for fp8 in (False, True)}


def measure(shape: Shape, name: str, kernel: Callable[..., Any], *, iters: int, device: torch.device
            ) -> dict[str, Any]:
    row: dict[str, Any] = dict(shape=shape.label, heads=shape.heads, tokens=shape.tokens, head_dim=shape.head_dim,
                               kernel=name)
    try:
        q, k, v = inputs(shape, device)
        few = tuple(t[:, :ERROR_HEADS].contiguous() for t in (q, k, v))
        ref, ref_lse = float_attention(*few)
        got = kernel(*few)
        out, lse = got if isinstance(got, tuple) else (got, None)
        row["error"] = ((out.float() - ref).norm() / ref.norm()).item()
        row["lse_error"] = None if lse is None else (lse.float() - ref_lse).abs().max().item()
        seconds = median_ms(lambda: kernel(q, k, v), iters) / 1e3
        row["ms"] = seconds * 1e3
        row["tflops"] = 4 * shape.heads * shape.tokens ** 2 * shape.head_dim / seconds / 1e12
    except Exception as exc:  # this kernel's row says why; the others are measured
        row["failed"] = repr(exc)[:1000]
    finally:
        torch.cuda.empty_cache()
    print(f"[attention] {shape.label:20} {name:30} " + (
        f"{row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s  error {row['error']:.4f}"
        + (f" lse {row['lse_error']:.4f}" if row["lse_error"] is not None else "")
        if "ms" in row else f"FAILED {row.get('failed')}"), file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of: {', '.join(SHAPES)} (default all)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--kernels", default=None, help="comma-separated kernel names to measure (default all)")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of the kernels, our Triton kernel's launch settings (sweep())")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    chosen = [SHAPES[label.strip()] for label in args.shapes.split(",") if label.strip()]
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels: no CUDA device here")
    device = torch.device("cuda")
    import triton

    rows = []
    for shape in chosen:
        found = sweep() if args.sweep else kernels(small=shape.tokens < 10_000)
        wanted = [name.strip() for name in args.kernels.split(",")] if args.kernels else list(found)
        for name, kernel in ((name, found[name]) for name in wanted if name in found):
            rows.append(measure(shape, name, kernel, iters=args.iters, device=device))
            if args.out:
                args.out.write_text(json.dumps(dict(
                    device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    python=platform.python_version(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

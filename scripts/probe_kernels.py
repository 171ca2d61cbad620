"""GPU probe: do other kernels narrow the gap between a FLUX ring-2 rank and half of 1 GPU?

    python scripts/probe_kernels.py [--out result.json]

At 1024² a ring-2 rank loses against half of 1 GPU in every kernel: the attention pays a fourth
round of CTAs for a quarter of its work, and the GEMMs of 2048-2304 rows run less efficiently
than those of 4096-4608 (docs/benchmarks.md, tenth session). Two other sets of kernels, timed
for both shapes (CUDA-graph replays, median, us):

1. Attention, 24 heads of 128, bf16, 4608 keys, 2304 queries (a rank) or 4608 (1 GPU): cuDNN
   through SDPA (what the engines run) against FlashAttention-3's forward kernel, read in the
   BSHD layout the projections write, with one split of the keys or two (its own combine
   kernel). FlashAttention-3 comes from `flash_attn_interface` (Dao-AILab's hopper build) or,
   where that is not installed, `fa3_fwd_interface` (PyPI `fa3-fwd`, the same forward kernels
   built for CUDA 13 and sm90a); the result names which ran.
2. Diffusers' FLUX blocks (single-stream at 2304 and 4608 tokens; double-stream at 2048 + 256
   and 4096 + 512) compiled by inductor in its default mode (cuBLAS GEMMs, what the engines run)
   and with max-autotune (inductor benchmarks Triton GEMM templates against cuBLAS for every
   shape and may fuse the bias and GELU into the GEMM), then also with Hopper's persistent TMA
   templates. Attention is the same kernel in every mode, so the differences are the GEMMs' and
   the pointwise kernels'.
cuBLAS runs without its workspace, as the engines set it on GPUs (engines.distributed).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engines.distributed import use_cublas_without_workspace

use_cublas_without_workspace()  # before the first cuBLAS call

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from probe_attention_split import probe_output, replay_us, write_result  # noqa: E402  (this folder: run as scripts/probe_kernels.py)

COMPILE_MODES = {
    "default": {},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune, persistent TMA": {"max_autotune": True, "coordinate_descent_tuning": True,
                                     "triton.enable_persistent_tma_matmul": True},
}


def flash_attention_3() -> tuple[str, Callable[..., torch.Tensor]] | None:
    """(module name, flash_attn_func) of the first FlashAttention-3 build that imports, else None."""
    for name in ("flash_attn_interface", "fa3_fwd_interface"):
        try:
            return name, importlib.import_module(name).flash_attn_func
        except Exception as exc:  # noqa: BLE001 - report and try the next build
            print(f"{name}: {exc!r}", file=sys.stderr)
    return None


def attention_kernels(result: dict) -> None:
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    fa3 = flash_attention_3()
    result["flash_attention_3"] = fa3[0] if fa3 else None
    k, v = torch.randn(1, 4608, 24, 128, **bf16), torch.randn(1, 4608, 24, 128, **bf16)
    for queries in (2304, 4608):
        q = torch.randn(1, queries, 24, 128, **bf16)

        def cudnn(q=q) -> torch.Tensor:  # BHSD views of BSHD memory, as engines.attention calls it
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

        times = {"cudnn": replay_us(cudnn)}
        reference = cudnn().transpose(1, 2).float()
        if fa3 is not None:
            for splits in (1, 2):
                def flash(q=q, splits=splits) -> torch.Tensor:
                    out = fa3[1](q, k, v, num_splits=splits)
                    return out[0] if isinstance(out, tuple) else out

                name = f"fa3, {splits} split{'s' if splits > 1 else ''}"
                times[name] = replay_us(flash)
                times[f"{name}: max abs diff to cudnn"] = (flash().float() - reference).abs().max().item()
        result["attention_us"][f"{queries} queries"] = times
        print(f"attention, {queries} queries:", {n: round(t, 3) for n, t in times.items()}, flush=True)


def flux_blocks(result: dict, out: Path | None) -> None:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    blocks = {
        "single": FluxSingleTransformerBlock(3072, 24, 128).to(**bf16).eval(),
        "double": FluxTransformerBlock(3072, 24, 128).to(**bf16).eval(),
    }
    shapes = {"rank": (2048, 256), "1 GPU": (4096, 512)}  # image + text tokens
    temb = torch.randn(1, 3072, **bf16)
    for mode, options in COMPILE_MODES.items():
        for kind, block in blocks.items():
            for who, (image, text) in shapes.items():
                rotary = (torch.randn(image + text, 128, **bf16), torch.randn(image + text, 128, **bf16))
                hidden, encoder = torch.randn(1, image, 3072, **bf16), torch.randn(1, text, 3072, **bf16)
                torch._dynamo.reset()
                compiled = torch.compile(block, fullgraph=True, dynamic=False, options=options)
                start = time.perf_counter()
                with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    compiled(hidden, encoder, temb, rotary)
                    build_s = time.perf_counter() - start
                    us = replay_us(lambda: compiled(hidden, encoder, temb, rotary))
                key = f"{kind}, {who} ({image} + {text} tokens), {mode}"
                result["blocks_us"][key] = {"us": us, "build_s": build_s}
                print(f"{key}: {us:.1f} us (build {build_s:.0f} s)", flush=True)
                write_result(result, out)  # partial results survive a time limit


def main() -> None:
    out = probe_output(__doc__)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "attention_us": {}, "blocks_us": {}}
    attention_kernels(result)
    write_result(result, out)
    flux_blocks(result, out)


if __name__ == "__main__":
    main()

"""`--attention-precision int8` as one Triton kernel (SageAttention's method), for GPUs; engines/
quantized_attention.py quantizes Q and K (its _int8_blocks) and calls it on CUDA tensors where Triton is
installed (int8_attention_available).

Each program takes q_block queries of one batch and head (one INT8 scale, as the quantization's blocks) and walks
the keys k_block at a time (one scale each): S = (Q·Kᵀ in int32) x both scales x 1/sqrt(D), an online softmax in
float32 (in base 2: log2(e) is folded into Q's scale, as FlashAttention's kernels do, so each exponential is one
exp2), P rounded to FP16 and multiplied with the FP16 V, accumulated in float32. It writes the output in the
caller's dtype and the natural-log LSE of the smoothed scores; the caller adds back the smoothing's
q·mean(K)/sqrt(D).

Tested against the PyTorch reference under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1,
tests/test_engines_quantized_attention.py). On one H200 (Triton 3.6, docs/faster.md) it is 1.3% off float attention
and runs at up to 595 TFLOP/s alone, level with bf16 SDPA there, never ahead: a correct int8 path, not a fast one.
NUM_WARPS and NUM_STAGES are the sweep's best at a video's 75,600 tokens (benchmarks/attention_kernels.py --sweep).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

NUM_WARPS = 4
"""Warps per program (Triton's num_warps)."""
NUM_STAGES = 4
"""Software-pipelining stages of the key loop (Triton's num_stages)."""


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter (CPU tensors) is on: read once, as Triton reads it when it is imported."""


def int8_attention_available(q: torch.Tensor) -> bool:
    """Whether int8_attention can run q's attention: Triton installed, a power-of-two head dim from 16 to 256,
    a CUDA tensor (or any, under the Triton interpreter). Traceable by torch.compile (no lookups at call time)."""
    head_dim = q.shape[-1]
    shaped = 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    return shaped and (q.is_cuda or INTERPRETED) and TRITON_INSTALLED


@torch.library.custom_op("ulysses_studio::int8_attention", mutates_args=())
def int8_attention(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                   v: torch.Tensor, q_block: int, k_block: int, out_dtype: torch.dtype = torch.float32,
                   v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (B H Sq D, `out_dtype`) of INT8 q over INT8 k and FP16 v and its LSE (B H Sq, float32). An op of
    its own, so that torch.compile (fullgraph) and CUDA graphs take the kernel's launch as one opaque call.
    With v in float8_e4m3fn and its per-channel scale v_scale (B H D; SageAttention2's P·V in FP8), P is scaled
    by 448 and rounded to e4m3 and P·V is an FP8 product (half the rate of FP16's on an H200 in Triton: the
    benchmark's sweep measures it, the engines do not use it).

    Args:
        q, k: int8 (B H S D); q_scale, k_scale: float32 (B H blocks), one per q_block / k_block tokens (the
            kernel's tiles: powers of two, at least 16).
        v: float16 (B H Sk D), or float8_e4m3fn with v_scale.
    """
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    q, k, v = (t.contiguous() for t in (q, k, v))
    q_scale, k_scale = q_scale.contiguous().float(), k_scale.contiguous().float()
    fp8 = v.dtype == torch.float8_e4m3fn
    v_scale = v_scale.contiguous().float() if fp8 else q_scale  # without FP8 P·V the kernel reads none
    out = torch.empty(B, H, Sq, D, dtype=out_dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    grid = (-(-Sq // q_block), B * H)
    _kernel()[grid](q, k, v, q_scale, k_scale, v_scale, out, lse, Sq, Sk, q_scale.shape[-1], k_scale.shape[-1],
                    D ** -0.5 * math.log2(math.e), BLOCK_M=q_block, BLOCK_N=k_block, HEAD_DIM=D, PV_FP8=fp8,
                    num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out, lse


@int8_attention.register_fake
def _int8_attention_fake(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                         v: torch.Tensor, q_block: int, k_block: int, out_dtype: torch.dtype = torch.float32,
                         v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


_compiled = None


def _kernel():
    """The Triton kernel, defined at first use (Triton is imported only where it runs)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    @triton.jit
    def int8_attention_kernel(q_ptr, k_ptr, v_ptr, q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, Sq, Sk,
                              q_blocks, k_blocks, scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              HEAD_DIM: tl.constexpr, PV_FP8: tl.constexpr):
        block, head = tl.program_id(0), tl.program_id(1)  # head: batch x heads, flattened
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        q_base = head * Sq * HEAD_DIM
        q = tl.load(q_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < Sq, other=0)
        q_scale = tl.load(q_scale_ptr + head * q_blocks + block) * scale_log2  # scores in base 2
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        kv_base = head * Sk * HEAD_DIM
        for start in range(0, Sk, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            inside = cols < Sk
            k = tl.load(k_ptr + kv_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=inside[:, None], other=0)
            k_scale = tl.load(k_scale_ptr + head * k_blocks + start // BLOCK_N)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * (q_scale * k_scale)
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=inside[:, None], other=0.0)
            if PV_FP8:
                acc = acc * alpha[:, None] + tl.dot((p * 448.0).to(v.dtype), v, out_dtype=tl.float32)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v, out_dtype=tl.float32)
            m = m_new
        out = acc / row_sum[:, None]
        if PV_FP8:
            out = out * (tl.load(v_scale_ptr + head * HEAD_DIM + dims) / 448.0)[None, :]
        tl.store(out_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rows[:, None] < Sq)
        tl.store(lse_ptr + head * Sq + rows, (m + tl.log2(row_sum)) * 0.6931471805599453, mask=rows < Sq)  # x ln 2

    _compiled = int8_attention_kernel
    return _compiled


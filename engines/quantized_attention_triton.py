"""`--attention-precision int8` as one Triton kernel (SageAttention's method), for GPUs; engines/
quantized_attention.py quantizes Q and K (its _int8_blocks) and calls it on CUDA tensors where Triton is
installed (int8_attention_available).

Each program takes q_block queries of one batch and head (one INT8 scale, as the quantization's blocks) and walks
the keys k_block at a time (one scale each): S = (Q·Kᵀ in int32) x both scales x 1/sqrt(D), an online softmax in
float32, P rounded to FP16 and multiplied with the FP16 V, accumulated in float32. It writes the output and the
natural-log LSE of the smoothed scores; the caller adds back the smoothing's q·mean(K)/sqrt(D).

Tested against the PyTorch reference under the Triton interpreter on CPU tensors (TRITON_INTERPRET=1,
tests/test_engines_quantized_attention.py); not yet run or timed on a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def int8_attention_available(q: torch.Tensor) -> bool:
    """Whether int8_attention can run q's attention: Triton installed, a power-of-two head dim from 16 to 256,
    a CUDA tensor (or any, under the Triton interpreter)."""
    head_dim = q.shape[-1]
    shaped = 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    on_device = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return shaped and on_device and importlib.util.find_spec("triton") is not None


@torch.library.custom_op("ulysses_studio::int8_attention", mutates_args=())
def int8_attention(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                   v: torch.Tensor, q_block: int, k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (B H Sq D, float32) of INT8 q over INT8 k and FP16 v and its LSE (B H Sq, float32). An op of its
    own, so that torch.compile (fullgraph) and CUDA graphs take the kernel's launch as one opaque call.

    Args:
        q, k: int8 (B H S D); q_scale, k_scale: float32 (B H blocks), one per q_block / k_block tokens (the
            kernel's tiles: powers of two, at least 16).
        v: float16 (B H Sk D).
    """
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    q, k, v = (t.contiguous() for t in (q, k, v))
    q_scale, k_scale = q_scale.contiguous().float(), k_scale.contiguous().float()
    out = torch.empty(B, H, Sq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    grid = (-(-Sq // q_block), B * H)
    _kernel()[grid](q, k, v, q_scale, k_scale, out, lse, Sq, Sk, q_scale.shape[-1], k_scale.shape[-1],
                    D ** -0.5, BLOCK_M=q_block, BLOCK_N=k_block, HEAD_DIM=D)
    return out, lse


@int8_attention.register_fake
def _int8_attention_fake(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                         v: torch.Tensor, q_block: int, k_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:3], dtype=torch.float32)


_compiled = None


def _kernel():
    """The Triton kernel, defined at first use (Triton is imported only where it runs)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    @triton.jit
    def int8_attention_kernel(q_ptr, k_ptr, v_ptr, q_scale_ptr, k_scale_ptr, out_ptr, lse_ptr, Sq, Sk,
                              q_blocks, k_blocks, sm_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              HEAD_DIM: tl.constexpr):
        block, head = tl.program_id(0), tl.program_id(1)  # head: batch x heads, flattened
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        q_base = head * Sq * HEAD_DIM
        q = tl.load(q_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < Sq, other=0)
        q_scale = tl.load(q_scale_ptr + head * q_blocks + block) * sm_scale
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
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_base + cols[:, None] * HEAD_DIM + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v, out_dtype=tl.float32)
            m = m_new
        out = acc / row_sum[:, None]
        tl.store(out_ptr + q_base + rows[:, None] * HEAD_DIM + dims[None, :], out, mask=rows[:, None] < Sq)
        tl.store(lse_ptr + head * Sq + rows, m + tl.log(row_sum), mask=rows < Sq)

    _compiled = int8_attention_kernel
    return _compiled


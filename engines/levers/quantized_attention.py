"""Quantized attention, the reference in PyTorch: `--attention-precision int8` and `fp8` (engines.options).

    out, lse = quantized_attention_with_lse(q, k, v, "int8")     # BHSD in; BHSD out, float32 BHS LSE

The same contract as engines.parallel.attention.attention_with_lse (output in q's dtype, natural-log LSE over the keys
in float32), so that ring attention merges partial results of it unchanged (merge_attention).

- int8, SageAttention's published method (Zhang et al., "SageAttention", ICLR 2025): K smoothed by
  subtracting its mean over the tokens (per batch and head: softmax is unchanged by a constant added to a
  score row, and the smoothed K's outliers are gone), Q and K quantized to INT8 with one symmetric scale per
  block of tokens (Q blocks of 128, K blocks of 64, as its kernels tile them), Q·Kᵀ in integers then scaled,
  softmax in float32, P·V with P and V in FP16 (float32 accumulation).
- fp8: K smoothed the same way, then Q, K and V quantized to e4m3 with one scale per block of tokens (the
  same blocks), Q·Kᵀ and P·V of e4m3 values, P in e4m3 with a fixed scale of 448 (after its row maximum is
  subtracted every P is in [0, 1]; SageAttention2 scales P so). Smoothing is the measured choice: on random
  q, k, v with a K offset of 3 standard deviations (S 300, D 64), unsmoothed FP8 was 9.4% off (relative norm)
  with LSE errors up to 0.29, smoothed 5.1% and 0.027.
  On Hopper GPUs with FlashAttention-3's forward installed (the registry's fa3-fwd build, `pip install
  fa3-fwd`), its FP8 kernel runs it instead: the same smoothing, one scale per batch and head (its descales'
  granularity), P·V in FP8 inside the kernel. Measured on one H200 (docs/faster.md): 5.3-5.5% off on such
  inputs at FLUX's and Wan's shapes, as this reference is, and 1.57x bf16 attention at Wan 2.1 14B's 75,600
  tokens (compiled, quantization included); at FLUX's 4,608, 0.57x.

Q·Kᵀ of INT8 values is computed in float32 here: each product is at most 127² and a head of D <= 1040
sums to less than 2²⁴, so every partial sum is an integer float32 holds exactly: the same numbers as an
int32 accumulator. The LSE is that of the unsmoothed scores: smoothing subtracts q·mean(K)/sqrt(D) from each
score row, added back to the LSE (SageAttention2 does the same when asked for the LSE); blocks of a ring,
whose K means differ, merge correctly only so.

The queries are processed in QUERY_CHUNK rows at a time: an N x N score matrix is never held whole.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engines.levers.quantized_attention_triton import int8_attention, int8_attention_available
from engines.options import ATTENTION_PRECISIONS, check_choice

FA3_HEAD_DIMS = (64, 96, 128, 192, 256)
"""Head dims FlashAttention-3's FP8 forward is built for (fa3-fwd)."""

Q_BLOCK = 128
"""Tokens of Q sharing one quantization scale (SageAttention's BLKQ)."""
K_BLOCK = 64
"""Tokens of K (and of V, fp8) sharing one quantization scale (SageAttention's BLKK)."""
QUERY_CHUNK = 1024
"""Query rows whose scores are held at once (a multiple of Q_BLOCK, so chunks do not split a scale's block)."""
INT8_MAX = 127.0
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
P_SCALE = FP8_MAX
"""fp8's P·V: P (in [0, 1]) is multiplied by this before rounding to e4m3."""
SCALE_FLOOR = 1e-12
"""A block of zeros (padding) gets this maximum, not 0, so its scale divides nothing by zero."""


_precision = "full"
"""The attention precision in effect (one of ATTENTION_PRECISIONS): set by attention_precision, read by
engines.parallel.attention's kernel calls (_attention, attention_with_lse) and by diffusers' native attention."""
_fa3_forward: Callable[..., Any] | None = None
"""FlashAttention-3's forward op where it runs here (fa3-fwd installed, the current GPU a Hopper one): looked for
once by attention_precision, outside any compiled code, so that a traced call reads a plain value."""
_fa3_looked = False


@contextmanager
def attention_precision(precision: str) -> Iterator[None]:
    """Within: every attention kernel call at `precision` ("full", "fp8" or "int8"): each strategy's
    (engines.parallel.attention), and diffusers' native attention, which serves a model whose plan splits no sequence
    (one rank, --cfg-parallel or --tp alone). Under torch.compile the value is guarded on: a change recompiles."""
    global _precision, _fa3_forward, _fa3_looked
    check_choice("attention precision", precision, ATTENTION_PRECISIONS)
    if precision == "fp8" and not _fa3_looked:
        _fa3_forward, _fa3_looked = fa3_forward(), True
    # diffusers' dispatcher, where a model was made with it (a model's module imports it)
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    backends = dispatch._AttentionBackendRegistry._backends if dispatch is not None else {}
    name = dispatch.AttentionBackendName.NATIVE if dispatch is not None else None
    native = backends.get(name)
    before = _precision
    _precision = precision
    if precision != "full" and native is not None:
        backends[name] = _quantized_native(native)
    try:
        yield
    finally:
        _precision = before
        if native is not None:
            backends[name] = native


def fa3_forward() -> Callable[..., Any] | None:
    """FlashAttention-3's forward op (fa3-fwd's `_flash_attn_forward`) if it is installed and the current CUDA
    device is a Hopper GPU (compute capability 9.0, the only one it is built for); else None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None
    try:
        from fa3_fwd_interface import _flash_attn_forward
    except ImportError:
        return None
    return _flash_attn_forward


def precision_in_effect() -> str:
    """The attention precision in effect: "full" outside attention_precision."""
    return _precision


def precision_signature() -> str:
    """What the attention precision in effect adds to an engine's input signature (engines.levers.compile): nothing at
    full precision, else its name, so that a CUDA graph captured at one precision is never replayed at another."""
    return "" if _precision == "full" else f" attention={_precision}"


def _quantized_native(native: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """diffusers' native attention backend (BSHD) with its plain calls (no mask, causality, dropout, scale, LSE or
    diffusers' own context parallelism) at the precision in effect; the others as before."""

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
               return_lse: bool = False, _parallel_config: Any = None) -> torch.Tensor:
        plain = attn_mask is None and not dropout_p and not is_causal and scale is None and not return_lse
        if not plain or _parallel_config is not None or _precision == "full":
            return native(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, _parallel_config=_parallel_config)
        out = quantized_attention_with_lse(*(t.transpose(1, 2) for t in (query, key, value)), _precision)[0]
        return out.transpose(1, 2)

    return attend


def quantized_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (BHSD) of q over k, v at `precision` ("int8" or "fp8") and its float32 log-sum-exp (BHS).
    K/V may have fewer heads than q (grouped-query attention): each K/V head serves q.shape[1] / k.shape[1]."""
    if precision not in ("int8", "fp8"):
        raise ValueError(f"quantized attention is int8 or fp8, not {precision!r}")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5
    qf, kf, vf, correction = smoothed(q, k, v)
    if precision == "fp8" and _fa3_forward is not None and q.is_cuda and q.shape[-1] in FA3_HEAD_DIMS:
        return _fa3_fp8(_fa3_forward, qf, kf, vf, correction, q.dtype)
    if precision == "int8" and int8_attention_available(q):
        out, lse = int8_attention(*_int8_blocks(qf, Q_BLOCK), *_int8_blocks(kf, K_BLOCK), v.half(),
                                  Q_BLOCK, K_BLOCK, q.dtype)
        return out, lse + correction
    if precision == "int8":
        v_values = vf.half().float()
    else:
        v_stored, v_scale = quantize_blocks(vf, K_BLOCK, "fp8")
        v_values = v_stored * v_scale  # each key block's values times its scale, as the kernel's tile is
    k_stored, k_scale = quantize_blocks(kf, K_BLOCK, precision)
    outs, lses = [], []
    for start in range(0, q.shape[2], QUERY_CHUNK):
        q_stored, q_scale = quantize_blocks(qf[:, :, start:start + QUERY_CHUNK], Q_BLOCK, precision)
        scores = (q_stored @ k_stored.transpose(-1, -2)) * (q_scale * scale) * k_scale.transpose(-1, -2)
        row_max = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - row_max)
        row_sum = p.sum(dim=-1, keepdim=True)
        if precision == "int8":
            p = p.half().float()
        else:
            p = (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE
        outs.append((p @ v_values) / row_sum)
        lses.append((row_max + torch.log(row_sum)).squeeze(-1))
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2) + correction
    return out.to(q.dtype), lse


def smoothed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v (BHSD) in float32, k less its mean over the tokens, and the LSE's missing part, q·mean(K)/sqrt(D)
    (B, H, Sq): the smoothing every quantized kernel here starts from."""
    qf, kf, vf = q.float(), k.float(), v.float()
    mean = kf.mean(dim=2, keepdim=True)  # (B, H, 1, D)
    correction = (qf @ mean.transpose(-1, -2)).squeeze(-1) * q.shape[-1] ** -0.5
    return qf, kf - mean, vf, correction


def fa3_fp8_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """FlashAttention-3's FP8 inputs from float32 BHSD q, smoothed k and v: each in e4m3 with one scale per batch and
    head, as BSHD views (as it takes them), and its descales by keyword."""
    stored, descales = [], {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        top = x.abs().amax(dim=(2, 3)).clamp_min(SCALE_FLOOR) / FP8_MAX  # (B, H)
        stored.append((x / top[:, :, None, None]).to(torch.float8_e4m3fn).transpose(1, 2))
        descales[f"{name}_descale"] = top
    return stored, descales


def _fa3_fp8(forward: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, correction: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3's FP8 forward of float32 BHSD q, smoothed k and v (fa3_fp8_inputs); output in `dtype` (it
    writes bf16) and the LSE with the smoothing's `correction` added."""
    stored, descales = fa3_fp8_inputs(q, k, v)
    out, lse = forward(*stored, **descales)[:2]
    return out.transpose(1, 2).to(dtype), lse + correction


def _int8_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32, B H S D) as INT8 values (int8) and one scale per `block` tokens (B H blocks): the Triton
    kernel's inputs (engines.levers.quantized_attention_triton); the values and scales of quantize_blocks."""
    stored, scale = _quantized_blocks(x, block, "int8")
    return stored.to(torch.int8), scale[..., 0]


def quantize_blocks(x: torch.Tensor, block: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32, B H S D) as `precision` ("int8" or "fp8") stores it with one symmetric scale per `block`
    tokens of each head: the stored values (integers or e4m3 values, as float32) and each token's scale
    (B H S 1, its block's), so that stored * scale approximates x."""
    stored, scale = _quantized_blocks(x, block, precision)
    return stored, scale.repeat_interleave(block, dim=2)[:, :, :x.shape[2]]


def _quantized_blocks(x: torch.Tensor, block: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks' stored values (B H S D, float32) and each block's scale (B H blocks 1)."""
    B, H, S, D = x.shape
    blocks = -(-S // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, blocks * block - S)).reshape(B, H, blocks, block * D)
    top = INT8_MAX if precision == "int8" else FP8_MAX
    scale = padded.abs().amax(dim=-1, keepdim=True).clamp_min(SCALE_FLOOR) / top  # (B, H, blocks, 1)
    scaled = padded / scale
    if precision == "int8":
        stored = scaled.round().clamp(-INT8_MAX, INT8_MAX)
    else:
        stored = scaled.to(torch.float8_e4m3fn).float()
    return stored.reshape(B, H, blocks * block, D)[:, :, :S], scale

"""The FP8 arithmetic of one linear layer in plain ops, torchao's numbers: per-row quantization to float8_e4m3fn
and the scaled GEMM (torch._scaled_mm).

Both FP8 layer kinds call it: engines.levers.fp8's Fp8Linear (quantize_fp8's default) and a row-parallel shard made FP8
(engines.parallel.tensor_parallel.RowParallelLinear, whose activation scales are taken over the whole rows of its tp
group). engines/levers/fp8.py says which layers are quantized and how the recipe matches torchao's.
"""

from __future__ import annotations

import torch

from engines.parallel.collectives import all_reduce

ACTIVATION_AMAX_FLOOR = 1e-12
"""Smallest per-row absolute maximum an activation's scale is computed from (torchao's activation_value_lb):
far below any real activation, above zero."""

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: the largest float8_e4m3fn value, torchao's quant_max."""


def quantize_rows(x: torch.Tensor, floor: float | None = None, row_max: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` ([..., K]) quantized per row to float8_e4m3fn as torchao's per-row path does (_choose_scale_float8,
    _quantize_affine_float8), in plain ops: (float8 data [..., K], float32 scale [..., 1]).

    The scale is each row's absolute maximum (`row_max` [..., 1] in `x`'s dtype where given: a whole row's, of which
    `x` holds some columns), clamped below by `floor` (torchao's hp_value_lb) when given, divided by 448 in `x`'s
    dtype, then made float32 (so a bfloat16 input's scale is bfloat16-rounded, as torchao's); the data is x in
    float32 divided by its row's scale, clamped to +-448 and cast."""
    if row_max is None:
        row_max = x.abs().amax(dim=-1, keepdim=True)
    if floor is not None:
        row_max = torch.clamp(row_max, min=floor)
    scale = (row_max / E4M3_MAX).to(torch.float32)
    data = (x.to(torch.float32) / scale).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, *, use_fast_accum: bool = True,
                     group_name: str | None = None) -> torch.Tensor:
    """x @ weight.T + bias as torchao's Float8Tensor per-row linear computes it on its torch._scaled_mm path
    (_float8_addmm_impl): `x` ([..., K], any float dtype) quantized per token with ACTIVATION_AMAX_FLOOR, the
    float8 `weight` [N, K] and its float32 per-row `weight_scale` [N, 1]; one _scaled_mm of the rows [M, K] by the
    weight transposed (column-major [K, N]) with scale_a [M, 1], scale_b [1, N], fast accumulation (torchao's default
    Float8MMConfig off XPU), the output in `x`'s dtype, reshaped to [..., N]. The bias goes into the GEMM, except for
    a float32 output, where _scaled_mm takes none and it is added after (torchao's addmm_float8_unwrapped_inference).

    `group_name`: a row-parallel shard's partial product (RowParallelLinear, no bias): `x` holds this rank's columns
    of each token's row, quantized with its token's scale over all the tp group's columns (an all-reduce of one
    number a token), so the float8 values are one process's; `weight_scale`: the whole rows' (quantize_fp8's group)."""
    rows = x.reshape(-1, x.shape[-1])
    row_max = None
    if group_name is not None:
        row_max = all_reduce(rows.abs().amax(dim=-1, keepdim=True), group_name, op="max")
    data, scale = quantize_rows(rows, ACTIVATION_AMAX_FLOOR, row_max=row_max)
    fused_bias = bias if x.dtype != torch.float32 else None
    out = torch._scaled_mm(data, weight.t(), scale_a=scale, scale_b=weight_scale.t(), bias=fused_bias,
                           out_dtype=x.dtype, use_fast_accum=use_fast_accum)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])

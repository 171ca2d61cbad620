"""benchmarks.step's LoRA rows (--lora-rank): the merged ("fused") LoRA computes what the app's unfused one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.inputs import bench_model, build_random, parse_shapes
from benchmarks.step import attach_random_lora, first_output, merge_lora_terms, single_process_forward
from engines.weights.lora import detach_loras, has_lora


def _output(spec, model, kwargs) -> torch.Tensor:
    forward = single_process_forward(spec, model, torch.device("cpu"))
    try:
        return first_output(forward, kwargs).float()
    finally:
        forward.restore()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


SCALE = 8.0
"""The LoRA's request scale: the benchmark's random LoRA (B small) changes the output ~1% at scale 1; at 8, clearly
more than bf16's and FP8's rounding of the merged weights does."""


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("bf16", 1e-2), ("fp8", 1e-2)])
def test_fused_lora_matches_unfused(precision: str, tolerance: float, tmp_path: Path) -> None:
    """Tiny FLUX.1, one process: base, the app's LoRA, merged into the weights, unmerged; relative differences of
    the transformer's output within `tolerance` (float32: float rounding; bf16 and FP8: the weights' rounding)."""
    spec = bench_model("flux-dev", tiny=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # FP8: the CPU runs' float32 model
    model = build_random(spec, device=torch.device("cpu"), dtype=dtype)
    if precision == "fp8":
        from engines.levers.fp8 import fp8_layers, quantize_fp8

        quantize_fp8(model, spec.family.repeated_blocks)
        assert fp8_layers(model) > 0
    (shape,) = parse_shapes("64x64", video=False, text_tokens=16)
    kwargs, _ = spec.inputs(shape, batch=spec.family.bench.batch, device=torch.device("cpu"), dtype=dtype)
    base = _output(spec, model, kwargs)

    loras = attach_random_lora(spec, model, 8, tmp_path)
    assert loras.layers > 0
    loras.select([(loras.names[0], SCALE)])
    unfused = _output(spec, model, kwargs)
    loras.select([])
    assert torch.equal(_output(spec, model, kwargs), base)  # scale 0: the base layers' output exactly
    loras.select([(loras.names[0], SCALE)])

    terms = detach_loras(model)
    assert len(terms) == loras.layers and not any(has_lora(m) for m in model.modules())
    assert torch.equal(_output(spec, model, kwargs), base)  # detached: the base weights untouched
    merge_lora_terms(model, terms)
    fused = _output(spec, model, kwargs)
    merge_lora_terms(model, terms, sign=-1.0)
    unmerged = _output(spec, model, kwargs)

    effect, gap, back = _rel(unfused, base), _rel(fused, unfused), _rel(unmerged, base)
    print(f"{precision}: LoRA effect {effect:.2e}, fused vs unfused {gap:.2e}, unmerged vs base {back:.2e}")
    # The LoRA changes the output clearly; merged, it changes it the same way up to the weights' rounding
    # (bf16: one rounding of W + BA; FP8: a re-quantization, e4m3's 2^-4 relative step per weight)
    assert effect > 0.03  # the LoRA changes the output clearly
    assert gap < tolerance and back < tolerance  # merged: the same change; unmerged: the base again

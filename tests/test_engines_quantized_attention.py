"""Quantized attention (engines/levers/quantized_attention.py, --attention-precision) against float attention, its LSE
included; ring's merge of its partial results; N gloo ranks against one process on every strategy.

Error bounds, measured on these inputs (CPU, float32, D 64, K offset by 3 standard deviations, the outlier
SageAttention's smoothing removes): int8 1.2-1.3% relative norm, LSE within 0.009; fp8 5.1-5.4%, LSE within
0.03. The bounds below leave about 1.5x room.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from engines.levers.quantized_attention import QUERY_CHUNK, attention_precision, quantized_attention_with_lse
from engines.parallel.attention import attention_with_lse, merge_attention
from tests.helpers import flux_inputs, join_ranks, parallelize, randomize, spawn_ranks, tiny_flux

REPO = Path(__file__).resolve().parents[1]
BOUNDS = {"int8": (0.02, 0.015), "fp8": (0.08, 0.045)}
"""(relative norm of the output's error, largest LSE error) per precision."""


def _inputs(tokens: int, kv_tokens: int | None = None, heads: int = 4, kv_heads: int | None = None) -> tuple:
    torch.manual_seed(0)
    q = torch.randn(1, heads, tokens, 64)
    k = torch.randn(1, kv_heads or heads, kv_tokens or tokens, 64) + 3 * torch.randn(1, kv_heads or heads, 1, 64)
    v = torch.randn(1, kv_heads or heads, kv_tokens or tokens, 64)
    return q, k, v


def _errors(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor) -> tuple[float, float]:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item(), (lse - ref_lse).abs().max().item()


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [77, QUERY_CHUNK + 300])  # one query chunk, and two with a partial Q block
def test_matches_float_attention(precision: str, tokens: int) -> None:
    q, k, v = _inputs(tokens)
    ref, ref_lse = attention_with_lse(q, k, v)
    out, lse = quantized_attention_with_lse(q, k, v, precision)
    assert out.shape == ref.shape and out.dtype == q.dtype and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    error, lse_error = _errors(out, lse, ref, ref_lse)
    assert error <= BOUNDS[precision][0] and lse_error <= BOUNDS[precision][1], (error, lse_error)
    assert error > 1e-4  # it quantizes: not float attention by another name


def test_grouped_heads_and_bf16() -> None:
    q, k, v = (t.bfloat16() for t in _inputs(100, heads=4, kv_heads=2))
    ref, ref_lse = attention_with_lse(q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1))
    out, lse = quantized_attention_with_lse(q, k, v, "int8")
    assert out.dtype == torch.bfloat16
    error, lse_error = _errors(out, lse, ref, ref_lse)
    assert error <= BOUNDS["int8"][0] and lse_error <= BOUNDS["int8"][1], (error, lse_error)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_ring_merge_of_blocks(precision: str) -> None:
    """Ring attention's partial results (each key block its own smoothing mean and scales), merged by LSE, against
    float attention over every key: within the same bounds."""
    q, k, v = _inputs(200, kv_tokens=300)
    ref, ref_lse = attention_with_lse(q, k, v)
    out = lse = None
    with attention_precision(precision):
        for start, length in ((0, 70), (70, 130), (200, 100)):  # uneven blocks, as a padded ring's are
            out, lse = merge_attention(out, lse, *attention_with_lse(q, k[:, :, start:start + length],
                                                                     v[:, :, start:start + length]))
    error, lse_error = _errors(out, lse, ref, ref_lse)
    assert error <= BOUNDS[precision][0] and lse_error <= BOUNDS[precision][1], (error, lse_error)


TRITON_CHECK = """
import json, os, sys
import torch
from engines.parallel.attention import attention_with_lse
from engines.levers.quantized_attention import quantized_attention_with_lse
import engines.levers.quantized_attention_triton as kernel
from engines.levers.quantized_attention_triton import int8_attention_available
results = []
for tokens, kv_tokens, head_dim in ((77, 77, 64), (300, 130, 32)):
    torch.manual_seed(0)
    q, v = torch.randn(1, 2, tokens, head_dim), torch.randn(1, 2, kv_tokens, head_dim)
    k = torch.randn(1, 2, kv_tokens, head_dim) + 3 * torch.randn(1, 2, 1, head_dim)
    interpreted = int8_attention_available(q)
    out, lse = quantized_attention_with_lse(q, k, v, "int8")
    kernel.INTERPRETED = False  # CPU tensors then take the reference
    reference, reference_lse = quantized_attention_with_lse(q, k, v, "int8")
    float_out, float_lse = attention_with_lse(q, k, v)
    kernel.INTERPRETED = True
    results.append(dict(interpreted=interpreted, out=(out - reference).abs().max().item(),
                        lse=(lse - reference_lse).abs().max().item(),
                        error=((out - float_out).norm() / float_out.norm()).item(),
                        lse_error=(lse - float_lse).abs().max().item()))
print(json.dumps(results))
"""


def test_triton_kernel_equals_the_reference() -> None:
    """engines/levers/quantized_attention_triton.py under the Triton interpreter (CPU tensors) against the reference, in
    a process of its own (Triton reads TRITON_INTERPRET when it is imported): the same quantized values, only P's
    FP16 rounding differs (the kernel's running row maximum against the whole row's); measured at most 1.4e-4
    (output) and 1e-6 (LSE). Against float attention, the reference's bounds hold."""
    import subprocess
    import sys

    assert importlib.util.find_spec("triton") is not None, "triton is in the test extras (pyproject.toml)"
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for r in results:
        assert r["interpreted"], r
        assert r["out"] <= 1e-3 and r["lse"] <= 1e-5, r
        assert r["error"] <= BOUNDS["int8"][0] and r["lse_error"] <= BOUNDS["int8"][1], r


def test_flashattention3_fp8_call() -> None:
    """The FlashAttention-3 FP8 path's own work (engines.levers.quantized_attention._fa3_fp8: smoothing, a scale per
    batch and head, BSHD e4m3 inputs with their descales, the output's layout and the LSE's correction), through a
    stand-in for its CUDA kernel that computes exactly what the kernel's contract says (attention of the descaled
    e4m3 values, bf16 output, natural-log LSE): within fp8's bounds of float attention."""
    import engines.levers.quantized_attention as quantized

    def kernel(q, k, v, *, q_descale, k_descale, v_descale):  # BSHD e4m3; descales (B, H)
        values = [t.float().transpose(1, 2) * s[:, :, None, None] for t, s in ((q, q_descale), (k, k_descale),
                                                                               (v, v_descale))]
        out, lse = attention_with_lse(*values)
        return out.transpose(1, 2).bfloat16(), lse, None, None

    q, k, v = _inputs(300, kv_tokens=200)
    ref, ref_lse = attention_with_lse(q, k, v)
    correction = (q @ k.mean(2, keepdim=True).transpose(-1, -2)).squeeze(-1) * 64 ** -0.5
    out, lse = quantized._fa3_fp8(kernel, q, k - k.mean(2, keepdim=True), v, correction, torch.float32)
    error, lse_error = _errors(out, lse, ref, ref_lse)
    assert out.dtype == torch.float32
    assert error <= BOUNDS["fp8"][0] and lse_error <= BOUNDS["fp8"][1], (error, lse_error)
    assert error > 1e-3


def test_precision_is_scoped() -> None:
    q, k, v = _inputs(50)
    ref = attention_with_lse(q, k, v)[0]
    with attention_precision("int8"):
        inside = attention_with_lse(q, k, v)[0]
    assert torch.equal(attention_with_lse(q, k, v)[0], ref) and not torch.equal(inside, ref)
    with pytest.raises(ValueError, match="unknown attention precision"):
        with attention_precision("int4"):
            pass


def test_compiled_call_follows_precision() -> None:
    """torch.compile guards on the precision in effect: a change recompiles, never replays the other's graph."""
    q, k, v = _inputs(50)
    compiled = torch.compile(lambda q, k, v: attention_with_lse(q, k, v)[0], backend="eager", fullgraph=True)
    full = compiled(q, k, v)
    with attention_precision("int8"):
        quantized = compiled(q, k, v)
    assert torch.equal(full, attention_with_lse(q, k, v)[0])
    assert torch.equal(quantized, quantized_attention_with_lse(q, k, v, "int8")[0])


# N ranks against one process, both at the same quantized precision, against the kernel's own error there
# (the same model at full precision): a rank sees other quantization blocks than one process (ring and
# all-gather blocks, padding), so the two differ by rounding, never by more than the kernel's error.
PLANS = ("ulysses", "ring", "allgather", "cfg")


def _plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    return [ParallelPlan(cfg=2) if name == "cfg" else ParallelPlan.auto(world_size, 6, strategy=name) for name in PLANS]


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    model = randomize(tiny_flux())
    torch.manual_seed(1)
    kwargs = flux_inputs((3, 4), 5)
    results = []
    with torch.no_grad():
        full = model(**kwargs)[0]
        for precision in ("int8", "fp8"):
            with attention_precision(precision):
                one = model(**kwargs)[0]
            for plan in _plans(world_size):
                parallel = parallelize(model, ctx, plan)
                with attention_precision(precision):
                    got = parallel(**kwargs)[0]
                parallel.restore()
                results.append(dict(precision=precision, plan=plan.label, err=(got - one).abs().max().item(),
                                    own=(one - full).abs().max().item()))
        # --tp: each rank attends its share of the heads; the split is made in place, so on a copy, last
        from engines.parallel.plan import ParallelPlan

        plan = ParallelPlan(tp=world_size)
        split = parallelize(copy.deepcopy(model), ctx, plan)
        for precision in ("int8", "fp8"):
            with attention_precision(precision):
                one, got = model(**kwargs)[0], split(**kwargs)[0]
            results.append(dict(precision=precision, plan=plan.label, err=(got - one).abs().max().item(),
                                own=(one - full).abs().max().item()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


def test_ranks_equal_one_process(tmp_path: Path) -> None:
    """Every strategy, CFG groups and --tp on 2 ranks."""
    from engines.parallel.plan import ParallelPlan

    spawn_ranks(_worker, 2, str(tmp_path))
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert {r["plan"] for r in results} == {plan.label for plan in _plans(2)} | {ParallelPlan(tp=2).label}
        for r in results:
            assert r["own"] > 0, r  # the model's own attention was quantized too
            assert r["err"] <= r["own"], f"{r['precision']} {r['plan']} on rank {rank}: {r['err']:.3g} > {r['own']:.3g}"


def test_first_and_last_steps_run_full_precision() -> None:
    from engines.options import FULL_PRECISION_EDGE_STEPS, attention_precision_at

    assert FULL_PRECISION_EDGE_STEPS == 1
    assert [attention_precision_at("int8", i, 8) for i in range(8)] == ["full"] + ["int8"] * 6 + ["full"]
    assert [attention_precision_at("full", i, 4) for i in range(4)] == ["full"] * 4


def test_each_step_and_request_choose_the_precision() -> None:
    """A pipeline's step context (StagedPipeline.cache_step) sets the step's precision; a request may ask for full."""
    from engines.levers.quantized_attention import precision_in_effect
    from pipelines.registry import default_folder, get_spec
    from pipelines.requests import RequestError, make_request, read_limits
    from pipelines.stages import StagedPipeline

    spec = get_spec("tiny-flux")
    limits = read_limits(spec, default_folder(spec))
    pipe = StagedPipeline()
    pipe.attention_precision = "int8"
    seen = {}
    for choice in (True, False, "false"):
        request = make_request(spec, limits, prompt="a red circle", steps=4, quantized_attention=choice)
        steps = []
        for index in range(4):
            with pipe.cache_step(request, index, 4):
                steps.append(precision_in_effect())
        seen[choice] = steps
        assert precision_in_effect() == "full"
    assert seen == {True: ["full", "int8", "int8", "full"], False: ["full"] * 4, "false": ["full"] * 4}
    assert "quantized_attention" not in make_request(spec, limits, prompt="a").to_dict()
    assert make_request(spec, limits, prompt="a", quantized_attention=False).to_dict()["quantized_attention"] is False
    with pytest.raises(RequestError, match="quantized_attention must be true or false"):
        make_request(spec, limits, prompt="a", quantized_attention="sometimes")


def test_a_batch_line_may_ask_for_full_precision(tmp_path: Path) -> None:
    from app.commands.prompt_files import PromptLine, read_prompt_file, request_fields
    from pipelines.registry import default_folder, get_spec
    from pipelines.requests import make_request, read_limits

    spec = get_spec("tiny-flux")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a red circle", "quantized_attention": false}\n')
    (line,) = read_prompt_file(tmp_path / "prompts.jsonl")
    assert isinstance(line, PromptLine), line
    request = make_request(spec, read_limits(spec, default_folder(spec)), **request_fields(line, {}, tmp_path))
    assert request.quantized_attention is False


def test_run_option_and_cli() -> None:
    from app.commands.arguments import run_options
    from app.commands.cli import build_parser
    from engines.options import RunOptions

    assert RunOptions().attention_precision == "full"
    with pytest.raises(ValueError, match="unknown --attention-precision 'int4'"):
        RunOptions(attention_precision="int4")
    for command in ("generate", "serve", "batch", "build"):
        args = build_parser().parse_args([command, "--attention-precision", "int8", *_required(command)])
        assert run_options(args).attention_precision == "int8", command


def _required(command: str) -> list[str]:
    """What `command` needs besides its options."""
    return {"generate": ["--prompt", "a", "--out", "a.png"], "batch": ["prompts.txt", "--out", "out"]}.get(command, [])


def test_each_calls_error_on_a_models_activations() -> None:
    """benchmarks/attention_error.py: every attention call of a forward measured at each precision on the same q, k,
    v, the forward going on at full precision (its output equals a full-precision forward's), one record per call
    in block order, each within the kernel's bound."""
    from benchmarks.attention_error import call_errors, summary
    from engines.levers.quantized_attention import precision_in_effect
    from engines.parallel.distributed import ParallelContext
    from engines.parallel.plan import ParallelPlan

    torch.manual_seed(0)
    model = randomize(tiny_flux())
    one = ParallelContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), group=None,
                          control_group=None)
    forward = parallelize(model, one, ParallelPlan())
    inputs = flux_inputs((8, 8), 8, batch=1)
    with torch.no_grad():
        full = forward(**inputs)[0]
        with call_errors(("fp8", "int8"), forward) as records:
            measured = forward(**inputs)[0]
            again = forward(**inputs)[0]
    assert torch.equal(measured, full) and torch.equal(again, full)
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert [(r["forward"], r["call"]) for r in records] == [(f, c) for f in (0, 1) for c in range(blocks)]
    for precision, (bound, _) in BOUNDS.items():
        errors = [r[precision]["error"] for r in records]
        assert all(0 < e <= bound for e in errors), (precision, errors)
        assert summary(records, precision)["max_error"] == max(errors)
    assert summary(records, "int8")["mean_error"] < summary(records, "fp8")["mean_error"]
    assert precision_in_effect() == "full"

"""The GPU benchmark's code path, run tiny on CPU with 2 gloo ranks (torchrun)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, REPO, private_tmp, torchrun, torchrun_log_folders


def test_benchmark_tiny_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "flux-dev,cosmos-predict2-2b-video2world",
                   "--warmup", "1", "--iters", "2", "--out", str(out))
    tmp, env = private_tmp(tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert torchrun_log_folders(tmp) == []  # the tests' torchrun leaves no log folder behind
    rows = json.loads(out.read_text())["rows"]
    modes = {(r["model"], r["mode"]) for r in rows}
    for model in ("tiny-flux", "tiny-cosmos"):
        for mode in ("1 GPU", "ours ulysses-2", "ours ring-2", "ours allgather-2"):
            assert (model, mode) in modes
    assert ("tiny-cosmos", "ours cfg-2") in modes
    assert all(r["error"] is None and r["ms"] > 0 and r["speedup"] for r in rows), rows
    plans = {r["mode"]: r["plan"] for r in rows}  # each row names its plan, K/V exchange included
    assert plans["ours ring-2"] == "ring-2" and plans["ours allgather-2"] == "allgather-2"
    assert plans["1 GPU"] is None
    # every plan's output is checked against the 1 GPU row's: its row says how far (float32 on CPU: rounding)
    ours = [r for r in rows if r["mode"].startswith("ours")]
    assert all(r["vs_1_gpu"] is not None and r["vs_1_gpu"] < 1e-5 for r in ours), [
        (r["mode"], r["vs_1_gpu"]) for r in ours]
    assert "ours ulysses-2" in proc.stdout  # the table is printed on rank 0


def test_bench_command_tiny_writes_json_and_chart(tmp_path: Path) -> None:
    cmd = [PYTHON, "-m", "app", "bench", "--ranks", "2", "--tiny", "--out", str(tmp_path), "--",
           "--model", "flux-dev", "--sizes", "64x64", "--strategies", "ulysses", "--warmup", "1", "--iters", "1",
           "--cached-step", "--fp8"]
    tmp, env = private_tmp(tmp_path)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert torchrun_log_folders(tmp) == []  # bench's torchrun leaves no log folder behind
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {(r["mode"], r["backend"]) for r in rows} == {
        ("1 GPU", "eager"), ("1 GPU cached step", "eager"), ("ours ulysses-2", "eager"),
        ("ours ulysses-2 cached step", "eager"), ("1 GPU fp8", "eager"), ("ours ulysses-2 fp8", "eager")}
    assert all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    for mode in ("1 GPU fp8", "ours ulysses-2 fp8"):
        fp8 = next(r for r in rows if r["mode"] == mode)
        assert 0 < fp8["rel_error"] < 0.05, fp8  # FP8 rounding of a float32 tiny model: small, not zero
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # its last line says what it wrote (a command ends within 3 s of its last output: docs/app-on-gpus.md)
    assert proc.stdout.splitlines()[-1] == f"bench: wrote {tmp_path / 'bench.json'} and {tmp_path / 'bench.png'}"


def test_benchmark_tiny_peers_rows_say_why_they_did_not_run(tmp_path: Path) -> None:
    import importlib.util

    out = tmp_path / "bench.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "flux-dev", "--sizes", "64x64", "--strategies", "",
                   "--no-diffusers", "--peers", "xdit,cache-dit", "--warmup", "1", "--iters", "1", "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(r["mode"], r["backend"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("1 GPU", "eager"), ("xDiT ulysses-2", "eager"),
                         ("xDiT ulysses-2", "inductor-reduce-overhead"), ("cache-dit ulysses-2", "eager"),
                         ("cache-dit ulysses-2", "inductor-blocks")}
    assert rows[("1 GPU", "eager")]["error"] is None  # a peer that cannot run does not stop the others
    for backend in ("eager", "inductor-reduce-overhead"):  # no CUDA here
        assert rows[("xDiT ulysses-2", backend)]["error"] in (
            "xDiT is not installed (no module 'xfuser')", "xDiT needs CUDA (xfuser raises at import without a GPU)")
    for backend in ("eager", "inductor-blocks"):  # cache-dit runs on gloo ranks where it is installed
        row = rows[("cache-dit ulysses-2", backend)]
        if importlib.util.find_spec("cache_dit") is None:
            assert row["error"] == "cache-dit is not installed (no module 'cache_dit')"
        else:
            assert row["error"] is None and row["ms"] > 0
    assert "compile_repeated_blocks" in rows[("cache-dit ulysses-2", "inductor-blocks")]["note"]


def test_benchmark_tiny_cosmos3_with_diffusers_forward(tmp_path: Path) -> None:
    """Cosmos 3 (no embedded model: its family's tiny config) through every plan, and the diffusers model's
    own forward beside the 1 GPU rows (its compiled blocks: tests/test_pipelines_cosmos3.py)."""
    out = tmp_path / "bench.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "cosmos3-nano", "--text-tokens", "20",
                   "--diffusers-forward", "--warmup", "1", "--iters", "1",
                   "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    modes = {(r["mode"], r["backend"]) for r in rows}
    for mode in ("1 GPU", "ours ulysses-2", "ours ring-2", "ours allgather-2", "ours cfg-2"):
        assert (mode, "eager") in modes
    assert ("diffusers forward", "eager") in modes
    assert all(r["error"] is None and r["ms"] > 0 and r["model"] == "tiny-cosmos3" for r in rows), rows


def test_benchmark_tiny_tp_runs_last_and_fp8_parallel_skips_one_gpu(tmp_path: Path) -> None:
    """--tp 2 on 2 ranks adds one tp-2 row after the others (--no-single: no 1 GPU row); --fp8 parallel times FP8
    on the plans only, with --attention-precision each precision's rows after its full-precision ones."""
    out, fp8_out = tmp_path / "tp.json", tmp_path / "fp8.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "flux2-dev", "--sizes", "64x64", "--strategies",
                   "ulysses", "--no-cfg", "--tp", "2", "--no-single", "--warmup", "1", "--iters", "1", "--out",
                   str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["plan"]) for r in rows] == [("ours ulysses-2", "ulysses-2"), ("ours tp-2", "tp-2")]
    assert all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "flux-dev", "--sizes", "64x64", "--strategies",
                   "allgather", "--fp8", "parallel", "--attention-precision", "fp8", "--warmup", "1", "--iters", "1",
                   "--out", str(fp8_out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(fp8_out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["1 GPU", "ours allgather-2", "1 GPU attention fp8",
                                         "ours allgather-2 attention fp8", "ours allgather-2 fp8",
                                         "ours allgather-2 fp8 attention fp8"]
    assert all(r["error"] is None and r["ms"] > 0 for r in rows), rows
    # each quantized row carries its output's error against full precision on the same weights (the reference
    # kernel on CPU: a few percent), and each FP8 row its error against bf16
    assert all(0 < r["rel_error_attention"] < 0.2 for r in rows if "attention" in r["mode"]), rows
    assert all(0 < r["rel_error"] < 0.2 for r in rows if r["mode"] == "ours allgather-2 fp8"), rows
    refused = subprocess.run([PYTHON, "-m", "benchmarks.step", "--tiny", "--tp", "2", "--fp8"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # one process: no tp group of 2
    assert refused.returncode == 2 and "are not a multiple of it" in refused.stderr


def test_diffusers_parallelism_is_undone_for_the_rows_after_it() -> None:
    """The benchmark runs diffusers' Ulysses, then rows whose error figures run rank 0's model alone: its hooks and
    its processors' config come off again, and the model computes as before they went on."""
    import torch
    from diffusers import ContextParallelConfig, FluxTransformer2DModel
    from diffusers.hooks.context_parallel import apply_context_parallel

    from benchmarks.step import undo_diffusers_parallelism

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)).eval()
    inputs = dict(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 16),
                  pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3))
    with torch.no_grad():
        before = model(**inputs).sample
    config = ContextParallelConfig(ulysses_degree=2)  # what enable_parallelism leaves on the model, without ranks
    model._parallel_config = config
    for module in model.modules():
        if hasattr(getattr(module, "processor", None), "_parallel_config"):
            module.processor._parallel_config = config
    apply_context_parallel(model, config, model._cp_plan)
    assert any(getattr(module, "_diffusers_hook", None) and module._diffusers_hook.hooks for module in model.modules())
    undo_diffusers_parallelism(model)
    assert not any(getattr(module, "_diffusers_hook", None) and module._diffusers_hook.hooks
                   for module in model.modules())
    assert model._parallel_config is None
    assert all(getattr(getattr(module, "processor", None), "_parallel_config", None) is None
               for module in model.modules())
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, before)
    undo_diffusers_parallelism(model)  # a model without it is left as it is

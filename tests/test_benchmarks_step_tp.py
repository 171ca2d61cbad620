"""benchmarks.step's tensor-parallel rows: --tp-only on a transformer built split (no rank holds the whole model),
and --fp8 with --tp; the tiny Cosmos 3 config stands for Cosmos 3 Super."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks.inputs import bench_model, build_random
from benchmarks.step import build_split, parse_args
from engines.parallel.tensor_parallel import rank_parameters, split_weights
from engines.weights.lora import meta_transformer
from pipelines.family import load
from tests.helpers import REPO, torchrun


def test_build_split_is_each_ranks_share_of_the_whole_random_model() -> None:
    """Each rank's parameters are build_random's split in place (same values, buffers included), at the local shapes:
    together the ranks hold the model once, and none of them holds a split weight whole."""
    spec = bench_model("cosmos3-super", tiny=True)
    split_of = load(spec.family.tensor_parallel)
    meta = meta_transformer(spec.model_class, spec.config)
    split = split_of(meta, 2)
    whole_shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    total = sum(p.numel() for p in meta.parameters())
    for rank in (0, 1):
        part = build_split(spec, tp=2, rank=rank, device=torch.device("cpu"), dtype=torch.float32)
        reference = build_random(spec, device=torch.device("cpu"), dtype=torch.float32)
        split_weights(reference, split_of(reference, 2), tp=2, rank=rank)
        held = dict(part.named_parameters())
        assert held.keys() == dict(reference.named_parameters()).keys() == whole_shapes.keys()
        for name, parameter in reference.named_parameters():
            assert torch.equal(held[name], parameter), name
        buffers = dict(reference.named_buffers())
        assert buffers, "Cosmos 3's rotary tables"
        for name, buffer in part.named_buffers():
            assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name
        assert sum(p.numel() for p in held.values()) == rank_parameters(meta, split, 2) < 0.75 * total
        for layer in split.linears:
            local, whole = tuple(held[f"{layer}.weight"].shape), whole_shapes[f"{layer}.weight"]
            assert math.prod(local) * 2 == math.prod(whole), layer  # tiny: 8 query, 2 K/V heads, both halve


def test_tp_only_fp8_tiny_two_ranks(tmp_path: Path) -> None:
    """--tp-only --fp8 parallel: a bf16 tp row, then the FP8 one on the same (split) weights, and nothing else."""
    out = tmp_path / "tp.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "cosmos3-super", "--text-tokens", "20", "--no-cfg",
                   "--tp", "2", "--tp-only", "--fp8", "parallel", "--backends", "eager", "--warmup", "1", "--iters",
                   "1", "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["plan"], r["backend"]) for r in rows] == [("ours tp-2", "tp-2", "eager"),
                                                                    ("ours tp-2 fp8", "tp-2", "eager")]
    for row in rows:
        assert row["error"] is None and math.isfinite(row["ms"]) and row["ms"] > 0, row
        assert row["gpus"] == 2 and len(row["peak_gib_per_rank"]) == 2 and row["peak_gib"] is not None
        assert row["param_gib"] > 0 and "built split" in row["note"]
    assert "FP8 linears" in rows[1]["note"]


def test_tp_with_fp8_builds_the_tp_model_split_after_the_fp8_rows(tmp_path: Path) -> None:
    """--tp with --fp8 (not --tp-only): the whole model's rows and FP8 rows, then the tp rows, bf16 and FP8."""
    out = tmp_path / "tp.json"
    cmd = torchrun(2, "-m", "benchmarks.step", "--tiny", "--model", "flux2-dev", "--sizes", "64x64", "--strategies",
                   "ulysses", "--no-cfg", "--tp", "2", "--fp8", "parallel", "--warmup", "1", "--iters", "1",
                   "--out", str(out))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["1 GPU", "ours ulysses-2", "ours ulysses-2 fp8", "ours tp-2", "ours tp-2 fp8"]
    assert all(r["error"] is None and r["ms"] > 0 for r in rows), rows


@pytest.mark.parametrize(("argv", "world", "message"), [
    (["--tp-only"], "2", "--tp-only times the --tp rows alone"),
    (["--tp", "2", "--tp-only", "--cached-step"], "2", "does not combine with --diffusers-forward, --cached-step"),
    (["--tp", "2", "--tp-only", "--fp8", "--fp8-unfused"], "2", "or --fp8-unfused"),
    (["--tp", "2", "--fp8", "--fp8-linear", "torchao"], "2", "needs --fp8-linear scaled-mm"),
    (["--tp", "2"], "3", "are not a multiple of it"),
])
def test_tp_options_that_do_not_combine_are_refused(argv: list[str], world: str, message: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--tiny", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_tp_only_with_fp8_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_args(["--model", "cosmos3-super", "--tp", "2", "--tp-only", "--fp8", "parallel"])
    assert args.tp_only and args.fp8 == "parallel"

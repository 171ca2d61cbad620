"""benchmarks/plot.py: a clip composed from its stages and step rows, and the pictures drawn from the repository's
own result files."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.plot import compose_clips, main, scaling

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs" / "bench"


def _step(mode: str, gpus: int, ms: float, attention: str | None = None) -> dict:
    return {"model": "m", "shape": "s", "mode": mode, "gpus": gpus, "ms": ms, "attention": attention, "error": None}


def test_a_clip_is_its_stages_with_full_attention_on_the_edge_steps() -> None:
    generation = [{"mode": "1 GPU", "gpus": 1, "total_s": 9.0, "encode_s": 0.5, "decode_s": 2.0, "write_s": 1.0,
                   "step_s": [3.0, 3.0]},
                  {"mode": "ours ulysses-2", "gpus": 2, "total_s": 5.0, "encode_s": 0.5, "decode_s": 1.0,
                   "write_s": 1.0, "step_s": [1.5, 1.7, 1.6]}]
    steps = [_step("1 GPU", 1, 2000.0), _step("1 GPU attention fp8", 1, 1000.0, "fp8"),
             _step("1 GPU fp8", 1, 1800.0), _step("1 GPU fp8 attention fp8", 1, 800.0, "fp8"),
             _step("1 GPU cached step", 1, 50.0)]
    clips = {(c.gpus, c.label): c for c in compose_clips(generation, steps, count=10)}
    assert set(clips) == {(1, "bf16"), (1, "fp8 attention"), (1, "FP8 linears"), (1, "FP8 linears + fp8 attention"),
                          (2, "bf16")}
    assert clips[(1, "bf16")].seconds == {"encode": 0.5, "steps": 20.0, "decode": 2.0, "write": 1.0}
    # the first and last of 10 steps at full attention: 2 x 2.0 + 8 x 1.0; with FP8 linears 2 x 1.8 + 8 x 0.8
    assert clips[(1, "fp8 attention")].seconds["steps"] == pytest.approx(12.0)
    assert clips[(1, "FP8 linears + fp8 attention")].total == pytest.approx(0.5 + 3.6 + 6.4 + 2.0 + 1.0)
    # no step row at 2 GPUs: the generation's own steps (their median) give the bf16 step
    assert clips[(2, "bf16")].seconds["steps"] == pytest.approx(16.0)


def test_scaling_is_each_files_own_one_gpu_row_over_the_best_plan() -> None:
    rows = [_step("1 GPU", 1, 100.0), _step("ours ulysses-2", 2, 60.0), _step("ours ring-2", 2, 50.0),
            _step("ours ulysses-2 fp8", 2, 30.0), _step("diffusers ulysses-2", 2, 80.0),
            _step("diffusers ulysses-4", 4, float("nan"))]
    other_run = [_step("1 GPU", 1, 200.0), _step("ours ulysses-4", 4, 50.0)]
    curves = scaling([rows, other_run])
    assert curves[("m", "s")]["ours"] == {1: 1.0, 2: 2.0, 4: 4.0}
    assert curves[("m", "s")]["diffusers"] == {1: 1.0, 2: 1.25}


def test_the_docs_pictures_draw_from_the_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generation = sorted(BENCH.glob("2026-11-27-h200x4/wan14b-generation-*/wan14b-generation.json"))
    steps = [BENCH / "2026-11-28-h200x1-attention/wan14b-step-fp8-attention.json",
             BENCH / "2026-11-29-h200x1/wan14b-step-fp8-linears-and-attention.json",
             BENCH / "2026-11-27-h200x4/generic-4gpus/wan14b-step.json"]
    assert main(["clip", "--count", "40", "--out", str(tmp_path / "clip.png"),
                 "--generation", *map(str, generation), "--steps", *map(str, steps)]) == 0
    printed = capsys.readouterr().out
    assert "1 GPU(s), FP8 linears + fp8 attention: 570.7 s" in printed, printed
    assert "4 GPU(s), bf16: 234.6 s" in printed, printed
    assert main(["scaling", "--out", str(tmp_path / "scaling.png"),
                 str(BENCH / "2026-11-27-h200x4/generic-4gpus/wan14b-step.json"),
                 str(BENCH / "2026-11-27-h200x2-generic/wan14b-step.json")]) == 0
    assert "wan2.1-t2v-14b 81x720x1280 ours: 1 GPUs 1.00x, 2 GPUs 2.07x, 4 GPUs 3.99x" in capsys.readouterr().out
    for name in ("clip.png", "scaling.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""`ulysses-studio build` fills the engine cache that `generate` (like serve and batch) then reuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_build_then_reuse_in_generate(tmp_path):
    cache = tmp_path / "engines"
    common = ["--model", "tiny-flux", "--size", "64x64", "--backend", "inductor-blocks", "--engine-cache", str(cache)]

    cold = cli("build", *common, "--steps", "2")
    assert cold.returncode == 0, cold.stderr
    assert "rank 0: built in" in cold.stderr
    warm = cli("build", *common, "--steps", "2")
    assert warm.returncode == 0, warm.stderr
    assert "rank 0: cache hit in" in warm.stderr

    compiled, eager = tmp_path / "compiled.png", tmp_path / "eager.png"
    request = ["--prompt", "a red circle", "--seed", "3", "--steps", "2", "--quiet"]
    result = cli("generate", *common, *request, "--out", str(compiled))
    assert result.returncode == 0, result.stderr
    result = cli("generate", "--model", "tiny-flux", "--size", "64x64", "--backend", "eager", *request,
                 "--out", str(eager))
    assert result.returncode == 0, result.stderr
    a = np.asarray(Image.open(compiled)).astype(np.int16)
    b = np.asarray(Image.open(eager)).astype(np.int16)
    assert np.abs(a - b).max() <= 1


def test_bad_backend_is_a_usage_error():
    result = cli("build", "--model", "tiny-flux", "--backend", "warp-drive")
    assert result.returncode == 2
    assert "is not an engine" in result.stderr and "Traceback" not in result.stderr


def test_runtime_drops_engine_graphs_before_the_process_group(monkeypatch, tmp_path):
    """A CUDA graph that captured NCCL kernels hangs NCCL's teardown while it is alive (2x H200), so
    the runtime that serve, batch and build share drops its engines' graphs first."""
    import threading

    import engines.parallel.distributed
    from app.ranks.runtime import start_runtime
    from engines.levers.compile import Engine
    from engines.options import RunOptions
    from pipelines.registry import resolve_model

    seen = []
    real_shutdown = engines.parallel.distributed.shutdown

    def shutdown(ctx):
        seen.append({media: dict(pipeline.transformer._graphs) for media, pipeline in pipelines.items()})
        real_shutdown(ctx)

    monkeypatch.setattr(engines.parallel.distributed, "shutdown", shutdown)
    spec, folder = resolve_model("tiny-flux", None)
    options = RunOptions(device="cpu", rank_timeout=60, backend="inductor-blocks", engine_cache=tmp_path)
    with start_runtime([(spec, folder)], options, stop=threading.Event()) as runtime:
        pipelines = runtime.service.pipelines
        engine = pipelines["image"].transformer
        assert isinstance(engine, Engine)
        engine._graphs["a captured shape"] = object()  # what a +cudagraph engine holds after a request
    assert seen == [{"image": {}}]


def test_cuda_graphs_on_cpus_are_refused_before_any_rank_starts():
    """A backend with CUDA graphs where the ranks are CPUs is a usage error (it was a rank's traceback), and `build`
    without --backend on a machine without a GPU compiles what CPU ranks run."""
    import pytest

    from app.commands.arguments import OptionsError, check_graphs_have_gpus
    from app.commands.build import check_build
    from app.commands.cli import build_parser

    for backend in ("inductor-blocks+cudagraph", "inductor-blocks+blockgraph", "inductor+cudagraph"):
        with pytest.raises(OptionsError, match="CUDA graphs need GPUs"):
            check_graphs_have_gpus(backend, "cpu")
        with pytest.raises(OptionsError, match="use --backend inductor"):
            check_graphs_have_gpus(backend, None)  # this machine has no GPU
        check_graphs_have_gpus(backend, "cuda")
    check_graphs_have_gpus("inductor-blocks", "cpu")
    args = build_parser().parse_args(["build", "--model", "tiny-flux", "--size", "64x64"])
    assert check_build(args)[3].label == "inductor-blocks"

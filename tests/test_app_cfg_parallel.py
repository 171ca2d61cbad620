"""--cfg-parallel: the runtime that serve, batch, generate and build share runs Cosmos' two guidance
branches on two halves of the ranks, and the video equals the one-process video within one level.

Requests that cannot use it are refused before anything runs: guidance at or below 1 (one branch)
by the request check, an odd number of ranks by every rank at start-up, before any collective.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from engines.options import RunOptions
from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits
from tests.helpers import join_ranks, spawn_ranks

FIELDS = dict(prompt="a blue square moving right on a white background", seed=4, steps=3, frames=9, height=48,
              width=80)


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    join_ranks(rank, world_size, port)
    from app.ranks.runtime import start_runtime

    spec, folder = resolve_model("tiny-cosmos", None)
    with start_runtime([(spec, folder)], RunOptions(device="cpu", rank_timeout=60, cfg_parallel=True),
                       stop=threading.Event()) as runtime:
        if not runtime.is_main:
            runtime.service.follow()
            return
        request = make_request(spec, runtime.models["video"].limits, **FIELDS)
        frames = np.asarray(runtime.service.run("video", request).result)
        np.save(out, frames)
        Path(out).with_suffix(".txt").write_text(runtime.plan)


def test_cfg_parallel_video_equals_one_process(tmp_path: Path) -> None:
    out = tmp_path / "frames.npy"
    spawn_ranks(_rank, 2, str(out))
    assert "cfg-2" in out.with_suffix(".txt").read_text()
    spec, folder = resolve_model("tiny-cosmos", None)
    single = np.asarray(load_pipeline(spec, folder).generate(make_request(spec, read_limits(spec, folder), **FIELDS)))
    parallel = np.load(out)
    assert parallel.shape == single.shape == (9, 48, 80, 3)
    assert np.abs(parallel.astype(np.int16) - single.astype(np.int16)).max() <= 1


def test_cfg_parallel_refuses_requests_without_guidance() -> None:
    spec, folder = resolve_model("tiny-cosmos", None)
    limits = read_limits(spec, folder, cfg_parallel=True)
    with pytest.raises(RequestError, match="guidance must be above 1"):
        make_request(spec, limits, prompt="a red circle", guidance=1.0)
    make_request(spec, limits, prompt="a red circle", guidance=3.0)
    flux, flux_folder = resolve_model("tiny-flux", None)  # one branch (guidance-distilled): unaffected
    assert not read_limits(flux, flux_folder, cfg_parallel=True).guidance_split


def test_cfg_parallel_needs_an_even_number_of_ranks() -> None:
    from app.failures import StartupError
    from app.ranks.runtime import start_runtime

    spec, folder = resolve_model("tiny-cosmos", None)
    with pytest.raises(StartupError, match="even number of ranks, this run has 1"):
        with start_runtime([(spec, folder)], RunOptions(device="cpu", rank_timeout=5, cfg_parallel=True),
                           stop=threading.Event()):
            pass

"""The copy-engine all-to-all transport (engines/copy_engine.py) through FLUX, eager and compiled.

On GPUs the op moves data with peer copies through symmetric memory; on CPU it runs the group's
all-to-all (gloo), so what is checked here is everything around the transfers: on 2 gloo ranks,
- a Ulysses FLUX with all_to_all="copy-engine" equals the one-process model (eager), and its
  compiled engine (inductor, +overlap) equals eager;
- the compiled code calls the op, finishes it with funcol's wait_tensor, and keeps a matrix
  multiply between the two (the overlap window), like the NCCL transport;
- a bad transport is refused before any collective, with a message.
GPU runs (correctness against NCCL on 2 H200s, and speed) are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from test_engines_flux_overlap import windows
from test_engines_parallel import flux_inputs, free_port, randomize, tiny_flux

TOLERANCE = 1e-4
OP = "ulysses_studio.copy_engine_all_to_all"


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from torch._inductor.utils import run_and_get_code

    from engines import ParallelPlan, init_parallel, parallelize_transformer, shutdown
    from engines.compile import EngineOptions, prepare_engine

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    model = randomize(tiny_flux()).eval()
    torch.manual_seed(1)
    kwargs = flux_inputs((3, 3), 5, batch=1)  # 9 image + 5 text tokens: padded shards
    result: dict = {}
    with torch.no_grad():
        expected = model(**kwargs)[0]
        try:
            parallelize_transformer(model, ctx, ParallelPlan.auto(world_size, 6), all_to_all="carrier-pigeon")
        except ValueError as error:
            result["bad_transport"] = str(error)
        parallel = parallelize_transformer(model, ctx, ParallelPlan.auto(world_size, 6), all_to_all="copy-engine")
        eager = parallel(**kwargs)[0]
        result["eager_err"] = (eager - expected).abs().max().item()
        engine = prepare_engine(parallel, EngineOptions(backend="inductor", scope="blocks", overlap=True))
        compiled, codes = run_and_get_code(lambda: engine(**kwargs)[0])
        again = engine(**kwargs)[0]  # a second call reuses the workspace order (start, finish, start)
        engine.release()
        result["compiled_err"] = (compiled - eager).abs().max().item()
        result["again_err"] = (again - compiled).abs().max().item()
        result["windows"] = [windows(code, OP) for code in codes if OP in code]
        result["nccl_ops"] = sum(code.count("_c10d_functional.all_to_all_single") for code in codes)
        parallel.restore()
    result["scale"] = expected.abs().max().item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown(ctx)


def test_copy_engine_transport_matches_and_keeps_its_windows(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "carrier-pigeon" in r["bad_transport"] and "copy-engine" in r["bad_transport"], r
        scale = max(r["scale"], 1.0)
        assert r["eager_err"] <= TOLERANCE * scale, r
        assert r["compiled_err"] <= TOLERANCE * scale, r
        assert r["again_err"] == 0.0, r
        assert r["nccl_ops"] == 0, r  # every Ulysses all-to-all went through the op
        # the single block's graph: both all-to-alls have a matrix multiply in their window
        assert [1, 1] in [[min(n, 1) for n in w] for w in r["windows"]], r["windows"]


def test_copy_engine_needs_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.copy_engine import check_transport

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one host"):
        check_transport("copy-engine", object(), torch.device("cuda", 0))
    check_transport("nccl", object(), torch.device("cuda", 0))
    check_transport("copy-engine", None, torch.device("cuda", 0))  # one process: nothing to move

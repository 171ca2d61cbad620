"""K/V-axis plans on 2 gloo ranks: ring passes and all-gathers run under compute, eager and compiled.

"ring": engines.parallel.attention._ring_attention issues the pass of the K/V block it holds
(start_ring_shift), attends to that block, then waits (finish) before the next, in FLUX and Cosmos
alike. "allgather": one all-gather of K/V (GatherAttention); FLUX's blocks compute before waiting:
the single-stream blocks (OverlappedSingleBlock) their MLP and its share of proj_out, the
double-stream blocks their queries. Each strategy runs exactly the exchange it names. This test
checks, for FLUX and Cosmos, both strategies and both transports (NCCL's collectives, gloo here;
the copy-engine ops, which run gloo on CPU):
- the parallel model (eager) equals the one-process model;
- compiled with inductor and EngineOptions.overlap, the result equals eager (also on a second
  call, where the copy-engine ops reuse their buffer), and the generated code keeps an attention
  kernel between each K/V pass and its wait (Cosmos), and (FLUX) the matrix multiplies above
  between the all-gather and its wait: the order the GPU needs for overlap; with the copy engine no NCCL collective is
  left in the code, and the double block sends its keys ahead, its value projections running
  while they travel.
GPU runs of the copy-engine pass are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    cosmos_inputs,
    flux_inputs,
    join_ranks,
    parallelize,
    randomize,
    spawn_ranks,
    tiny_cosmos,
    tiny_flux,
)
from tests.test_engines_flux_overlap import MATMUL
from tests.test_engines_flux_overlap import windows as matmul_windows

TOLERANCE = 1e-4
NCCL_SHIFT = "_c10d_functional.all_to_all_single"
COPY_ENGINE_SHIFT = "ulysses_studio.copy_engine_shift"
START = {"nccl": NCCL_SHIFT, "copy-engine": COPY_ENGINE_SHIFT}
GATHER = {"nccl": "_c10d_functional.all_gather_into_tensor", "copy-engine": "ulysses_studio.copy_engine_gather_kv"}
ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
BLOCKS = {"flux": ("transformer_blocks", "single_transformer_blocks"), "cosmos": ("transformer_blocks",)}


def attention_windows(code: str, start: str) -> list[int]:
    """Attention calls between each K/V pass (a line calling `start`) and its wait, in code order."""
    counts, open_count = [], None
    for line in code.splitlines():
        if start in line and "=" in line:
            open_count = 0
        elif "_c10d_functional.wait_tensor" in line and open_count is not None:
            counts.append(open_count)
            open_count = None
        elif open_count is not None and ATTENTION in line and "=" in line:
            open_count += 1
    return counts


def keys_ahead(code: str, start: str) -> list[int]:
    """Matrix multiplies between a K/V gather (a line calling `start`) and a second one issued
    before any wait, in code order: the value projections made while the keys travel."""
    counts, open_count = [], None
    for line in code.splitlines():
        if start in line and "=" in line:
            if open_count is not None:
                counts.append(open_count)
            open_count = 0
        elif "_c10d_functional.wait_tensor" in line:
            open_count = None
        elif open_count is not None and MATMUL.search(line):
            open_count += 1
    return counts


def _worker(rank: int, world_size: int, port: int, out_dir: str, transport: str) -> None:
    join_ranks(rank, world_size, port)
    from torch._inductor.utils import run_and_get_code

    from engines.levers.compile import prepare_engine
    from engines.options import EngineOptions
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan

    ctx = init_parallel("cpu")
    results = {}
    for name, strategy in (("flux", "ring"), ("flux", "allgather"), ("cosmos", "ring"), ("cosmos", "allgather")):
        torch.manual_seed(0)
        model = randomize(tiny_flux() if name == "flux" else tiny_cosmos()).eval()
        torch.manual_seed(1)
        # token counts that 2 does not divide: padded shards
        kwargs = flux_inputs((3, 3), 5, batch=1) if name == "flux" else cosmos_inputs((3, 3, 3))
        result: dict = {}
        torch._dynamo.reset()
        with torch.no_grad():
            expected = model(**kwargs)[0]
            plan = ParallelPlan.auto(world_size, 6, strategy=strategy)
            parallel = parallelize(model, ctx, plan, all_to_all=transport)
            eager = parallel(**kwargs)[0]
            engine = prepare_engine(parallel, EngineOptions(backend="inductor", scope="blocks", overlap=True),
                                    repeated_blocks=BLOCKS[name])
            output, codes = run_and_get_code(engine, **kwargs)
            compiled = output[0]
            again = engine(**kwargs)[0]
            engine.release()
            parallel.restore()
        start = START[transport]
        result["eager_err"] = (eager - expected).abs().max().item()
        result["compiled_err"] = (compiled - eager).abs().max().item()
        result["again_err"] = (again - compiled).abs().max().item()
        result["windows"] = [w for code in codes if (w := attention_windows(code, start))]
        result["gather_windows"] = [w for code in codes if (w := matmul_windows(code, GATHER[transport]))]
        result["keys_ahead"] = [w for code in codes if (w := keys_ahead(code, GATHER[transport]))]
        result["gathered_attention"] = sum("ulysses_studio.gathered_attention" in line and "=" in line
                                           for code in codes for line in code.splitlines())
        result["nccl_ops"] = sum(code.count(NCCL_SHIFT) + code.count(GATHER["nccl"]) for code in codes)
        result["scale"] = expected.abs().max().item()
        results[f"{name} {plan.label}"] = result
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("transport", ["nccl", "copy-engine"])
def test_kv_exchanges_overlap_compute(tmp_path: Path, transport: str) -> None:
    spawn_ranks(_worker, 2, str(tmp_path), transport)
    for rank in range(2):
        for case, r in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            case = f"{case}, {transport}, rank {rank}"
            bound = TOLERANCE * max(r["scale"], 1.0)
            assert r["eager_err"] <= bound, (case, r)
            assert r["compiled_err"] <= bound, (case, r)
            assert r["again_err"] == 0.0, (case, r)
            if transport == "copy-engine":
                assert r["nccl_ops"] == 0, (case, r)  # every K/V exchange went through the ops
            if case.startswith("flux allgather"):
                # each block gathers K/V once: the double block projects its queries (image and text:
                # 2 matrix multiplies) while K/V travel, the single block runs its MLP and the MLP's
                # share of proj_out (2).
                assert not r["windows"], (case, r)
                assert r["gather_windows"] == [[2], [2]], (case, r)
                # copy engines: the double block's keys go ahead, and its value projections (image
                # and text) run while they travel; NCCL gathers keys and values in one collective
                assert r["keys_ahead"] == ([[2]] if transport == "copy-engine" else []), (case, r)
                # copy engines: each block graph reads the gathered K/V in the exchange buffer
                assert r["gathered_attention"] == (2 if transport == "copy-engine" else 0), (case, r)
            elif case.startswith("cosmos allgather"):
                # one gather per block, waited for at once (Cosmos' blocks have nothing to put beside it)
                assert not r["windows"] and r["gather_windows"], (case, r)
                assert all(w == [0] for w in r["gather_windows"]), (case, r)
                graphs = len(r["gather_windows"])  # one per compiled block graph
                assert r["gathered_attention"] == (graphs if transport == "copy-engine" else 0), (case, r)
            else:
                # ring: every compiled block graph that passes K/V does it once, its local attention
                # inside the window; no all-gather
                assert r["windows"] and all(w == [1] for w in r["windows"]), (case, r["windows"])
                assert not r["gather_windows"], (case, r)

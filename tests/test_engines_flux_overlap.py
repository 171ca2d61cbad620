"""FLUX single-stream blocks under Ulysses: the MLP runs inside the all-to-alls' windows, eager and compiled.

pipelines.flux.blocks.OverlappedSingleBlock issues the q/k/v all-to-all, computes the MLP, waits, attends,
issues the output all-to-all, computes the MLP's share of proj_out, waits. On 2 gloo ranks this test
checks that
- parallelize_flux installs it on every single-stream block for a Ulysses plan (and ring and
  all-gather plans: tests/test_engines_ring_overlap.py) and restore() puts diffusers' blocks back;
- the AdaLN modulation projections are shared out over the ranks (engines.parallel.modulation.SharedModulation:
  both ranks own some, the norms skip theirs), and restore() puts them back too: the plain model
  then gives its original output;
- the parallel model (eager) equals the one-process model;
- compiled with inductor and EngineOptions.overlap, the generated code keeps a matrix multiply
  between each all-to-all and its wait (the order the GPU needs for overlap), and equals eager.
Both all-to-all transports are checked: NCCL's (gloo here) and the copy-engine op
(engines/parallel/copy_engine.py, which runs gloo's all-to-all on CPU): with the latter, no funcol
all-to-all is left in the compiled code. GPU runs of the copy-engine op are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import flux_inputs, join_ranks, parallelize, randomize, spawn_ranks, tiny_flux

TOLERANCE = 1e-4


NCCL_ALL_TO_ALL = "_c10d_functional.all_to_all_single"
COPY_ENGINE_ALL_TO_ALL = "ulysses_studio.copy_engine_all_to_all"
START = {"nccl": NCCL_ALL_TO_ALL, "copy-engine": COPY_ENGINE_ALL_TO_ALL}


MATMUL = re.compile(r"extern_kernels\.(addmm|mm)\(|ulysses_studio\.linear_after\.default\(")
"""A matrix multiply in generated code: inductor's, or collectives.linear_after."""


def windows(code: str, start: str = NCCL_ALL_TO_ALL) -> list[int]:
    """Matrix multiplies (inductor's, or collectives.linear_after) between each all-to-all (a line
    calling `start`) and its wait, in generated-code order."""
    counts, open_count = [], None
    for line in code.splitlines():
        if start in line and "=" in line:
            open_count = 0
        elif "_c10d_functional.wait_tensor" in line and open_count is not None:
            counts.append(open_count)
            open_count = None
        elif open_count is not None and MATMUL.search(line):
            open_count += 1
    return counts


def norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FLUX's AdaLN norms, whose projections SharedModulation computes ahead (blocks seen through
    OverlappedSingleBlock)."""
    singles = [getattr(b, "block", b) for b in model.single_transformer_blocks]
    return ([n for b in model.transformer_blocks for n in (b.norm1, b.norm1_context)]
            + [b.norm for b in singles] + [model.norm_out])


def _worker(rank: int, world_size: int, port: int, out_dir: str, transport: str) -> None:
    join_ranks(rank, world_size, port)
    from torch._inductor.utils import run_and_get_code

    from engines.levers.compile import prepare_engine
    from engines.options import EngineOptions
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan
    from pipelines.flux.blocks import OverlappedSingleBlock

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    model = randomize(tiny_flux()).eval()
    originals = list(model.single_transformer_blocks)
    torch.manual_seed(1)
    kwargs = flux_inputs((3, 3), 5, batch=1)  # 9 image + 5 text tokens: padded shards
    result: dict = {}
    with torch.no_grad():
        expected = model(**kwargs)[0]

        for strategy in ("ring", "allgather"):
            other = parallelize(model, ctx, ParallelPlan.auto(world_size, 6, strategy=strategy), all_to_all=transport)
            result[f"{strategy}_blocks_replaced"] = [isinstance(b, OverlappedSingleBlock)
                                                     for b in model.single_transformer_blocks]
            other.restore()

        parallel = parallelize(model, ctx, ParallelPlan.auto(world_size, 6), all_to_all=transport)
        result["ulysses_blocks_replaced"] = all(isinstance(b, OverlappedSingleBlock)
                                                for b in model.single_transformer_blocks)
        # the modulation projections are shared out: both ranks own some, and the norms skip theirs
        result["modulation_owners"] = sorted(set(parallel.modulation.owner))
        result["projections_skipped"] = all(not isinstance(n.linear, torch.nn.Linear) for n in norms(model))
        eager = parallel(**kwargs)[0]
        result["eager_err"] = (eager - expected).abs().max().item()

        block = model.single_transformer_blocks[0]
        engine = prepare_engine(parallel, EngineOptions(backend="inductor", scope="blocks", overlap=True),
                                repeated_blocks=("transformer_blocks", "single_transformer_blocks"))
        compiled, codes = run_and_get_code(lambda: engine(**kwargs)[0])
        again = engine(**kwargs)[0]  # a second call: the copy-engine op reuses its buffer
        engine.release()
        result["compiled_err"] = (compiled - eager).abs().max().item()
        result["again_err"] = (again - compiled).abs().max().item()
        # the single block's graph is the one whose code starts with the norm and holds two all-to-alls
        start = START[transport]
        result["windows"] = [windows(code, start) for code in codes if code.count(f"{start}.default(") == 2]
        result["nccl_ops"] = sum(code.count(NCCL_ALL_TO_ALL) for code in codes)
        result["block_kept"] = model.single_transformer_blocks[0] is block
        parallel.restore()
    result["restored"] = all(a is b for a, b in zip(model.single_transformer_blocks, originals, strict=True))
    result["projections_restored"] = all(isinstance(n.linear, torch.nn.Linear) and isinstance(n.silu, torch.nn.SiLU)
                                         for n in norms(model))
    with torch.no_grad():
        result["restored_err"] = (model(**kwargs)[0] - expected).abs().max().item()
    result["scale"] = expected.abs().max().item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown(ctx)


@pytest.mark.parametrize("transport", ["nccl", "copy-engine"])
def test_single_blocks_overlap_their_all_to_alls(tmp_path: Path, transport: str) -> None:
    spawn_ranks(_worker, 2, str(tmp_path), transport)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["ulysses_blocks_replaced"], r
        assert all(r["ring_blocks_replaced"]) and all(r["allgather_blocks_replaced"]), r
        assert r["block_kept"] and r["restored"], r
        assert r["modulation_owners"] == [0, 1] and r["projections_skipped"], r
        assert r["projections_restored"] and r["restored_err"] == 0.0, r
        assert r["eager_err"] <= TOLERANCE * max(r["scale"], 1.0), r
        assert r["compiled_err"] <= TOLERANCE * max(r["scale"], 1.0), r
        assert r["again_err"] == 0.0, r
        if transport == "copy-engine":
            assert r["nccl_ops"] == 0, r  # every Ulysses all-to-all went through the op
        # double blocks' graphs have two all-to-alls too but nothing to put in their windows; at least
        # one graph (the single block, compiled once per class) must fill both windows
        assert [1, 1] in [[min(n, 1) for n in w] for w in r["windows"]], r["windows"]

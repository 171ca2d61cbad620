"""--cache (engines/levers/step_cache.py): a metric that differs between ranks still gives one decision; the options'
checks; what a graph overwrites is kept.

(Every rank skips exactly the steps one process skips and draws the same, for each family, under every kind of split:
the step-cache cases of tests/test_conformance.py.)

(tiny-flux keeps its held-out scores with the default threshold: tests/test_tiny_quality.py.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import join_ranks, spawn_ranks


def _disagreeing_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """Ranks whose own measurements disagree (alone, rank 0 would skip every step and rank 1 compute every
    step, and they would wait for each other in different collectives) still take one decision per step:
    the one their summed measurements give (0.9 / 2 = 0.45, below the threshold 0.5: skip)."""
    join_ranks(rank, world_size, port)
    import torch

    from engines.levers.step_cache import install_step_cache
    from engines.options import CacheOptions
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan
    from tests.helpers import flux_inputs, parallelize, tiny_flux

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    model = parallelize(tiny_flux(), ctx, ParallelPlan.auto(world_size, 6))
    cache = install_step_cache(model, CacheOptions(threshold=0.5), block_lists=("transformer_blocks",
                               "single_transformer_blocks"), outputs=(("encoder_hidden_states", "hidden_states"),) * 2,
                               stream="hidden_states", group=torch.distributed.group.WORLD)
    mine = [0.1, 1.0] if rank == 0 else [0.8, 1.0]  # (change, scale): 0.1 alone skips, 0.8 alone computes
    cache.metric = lambda now, reference: torch.tensor(mine, dtype=torch.float64)
    inputs = flux_inputs((4, 6), text_tokens=8, batch=1)
    for step in range(6):
        with cache.step(step, 6):
            model(**inputs)
    np.save(f"{out}{rank}.npy", np.asarray(cache.skipped + [-1], dtype=np.int64))
    shutdown(ctx)


def test_ranks_whose_metrics_disagree_take_one_decision(tmp_path: Path) -> None:
    spawn_ranks(_disagreeing_rank, 2, str(tmp_path / "skipped"))
    assert [np.load(tmp_path / f"skipped{rank}.npy").tolist() for rank in range(2)] == [[1, 2, 3, 4, -1]] * 2


def test_cache_options_are_checked() -> None:
    from engines.options import CacheOptions, RunOptions

    assert CacheOptions.parse("fbcache").threshold == 0.08
    assert CacheOptions.parse("fbcache:0.12").label == "fbcache:0.12"
    for bad, said in (("teacache", "unknown step cache"), ("fbcache:lots", "must be a number"),
                      ("fbcache:0", "above 0")):
        with pytest.raises(ValueError, match=said):
            CacheOptions.parse(bad)
    for backend in ("inductor", "inductor-blocks+cudagraph"):
        with pytest.raises(ValueError, match="outside the compiled graphs"):
            RunOptions(cache="fbcache", backend=backend)
    RunOptions(cache="fbcache", backend="inductor-blocks")
    RunOptions(cache="fbcache", backend="inductor-blocks+overlap+blockgraph")  # a CUDA graph per block


def test_engine_options_with_a_cuda_graph_per_block() -> None:
    from engines.options import EngineOptions

    options = EngineOptions.parse("inductor-blocks+overlap+blockgraph")
    assert options.block_graphs and options.keeps_block_loop and not options.cuda_graph
    assert options.label == "inductor-blocks+overlap+blockgraph"
    for bad, said in (("inductor+blockgraph", "inductor-blocks only"), ("eager+blockgraph", "inductor-blocks only"),
                      ("inductor-blocks+cudagraph+blockgraph", "exclude each other")):
        with pytest.raises(ValueError, match=said):
            EngineOptions.parse(bad)


class _GraphLike(torch.nn.Module):
    """A block whose outputs live in buffers that its next call overwrites, as a CUDA graph's do at its next
    replay: what +blockgraph's blocks hand the step cache."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        # as torch.compile's wrapper names it: the cache reads its signature
        self._orig_mod, self.buffers_ = block, None

    def forward(self, *args, **kwargs):
        out = self._orig_mod(*args, **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        if self.buffers_ is None:
            self.buffers_ = tuple(torch.empty_like(t) for t in out)
        for buffer, t in zip(self.buffers_, out):
            buffer.copy_(t)
        return self.buffers_ if len(out) > 1 else self.buffers_[0]


def test_the_cache_keeps_copies_of_what_a_graph_overwrites() -> None:
    """Blocks whose outputs are overwritten at their next call (a CUDA graph per block) give the outputs and
    decisions of plain blocks: the cache keeps copies of the first and last blocks' outputs across steps."""
    from engines.levers.step_cache import install_step_cache
    from engines.options import CacheOptions
    from tests.helpers import flux_inputs, tiny_flux

    torch.manual_seed(0)
    plain, graphed = tiny_flux().eval(), tiny_flux().eval()
    graphed.load_state_dict(plain.state_dict())
    lists = ("transformer_blocks", "single_transformer_blocks")
    for name in lists:
        blocks = getattr(graphed, name)
        for index in range(len(blocks)):
            blocks[index] = _GraphLike(blocks[index])
    inputs = flux_inputs((4, 6), text_tokens=8, batch=1)
    results = []
    for model, copies in ((plain, False), (graphed, True), (graphed, False)):
        cache = install_step_cache(model, CacheOptions(threshold=0.02), block_lists=lists, copies=copies,
                                   outputs=(("encoder_hidden_states", "hidden_states"),) * 2, stream="hidden_states")
        outputs = []
        for step in range(6):
            step_inputs = {**inputs, "hidden_states": inputs["hidden_states"] * (1 + 0.05 * step)}
            with cache.step(step, 6), torch.no_grad():
                outputs.append(model(**step_inputs)[0])
        results.append((outputs, cache.skipped))
        cache.remove()
    (plain_out, plain_skipped), (graphed_out, graphed_skipped), (uncopied_out, _) = results
    assert plain_skipped == graphed_skipped == [1, 3], (plain_skipped, graphed_skipped)  # skips and computes between
    for a, b in zip(plain_out, graphed_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # without the copies a skipped step reads what later calls wrote over: another output
    assert max((a - b).abs().max().item() for a, b in zip(plain_out, uncopied_out)) > 1e-3

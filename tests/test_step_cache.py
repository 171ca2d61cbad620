"""--cache (engines/levers/step_cache.py): every rank skips exactly the steps one process skips and draws the same,
for each family, under every kind of split (sequence shards with padding, guidance halves in one batch or
as separate calls); a metric that differs between ranks still gives one decision; the options' checks.

(tiny-flux keeps its held-out scores with the default threshold: tests/test_tiny_quality.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.registry import resolve_model
from pipelines.requests import make_request, read_limits
from tests.helpers import join_ranks, spawn_ranks

# Thresholds that make 6-8 step requests skip some steps but not all (each case asserts it): above the default
# for the trained tiny models, far below it for Cosmos 3's tiny random weights, far above for FLUX.2's.
CASES = {
    # name: (model, world size, run options); each model's request: FIELDS
    "flux ulysses-2": ("tiny-flux", 2, dict(strategy="ulysses")),  # 35 image tokens: the last shard is padded
    "flux allgather-4": ("tiny-flux", 4, dict(strategy="allgather")),
    "cosmos cfg-2": ("tiny-cosmos", 2, dict(cfg_parallel=True)),  # guidance halves of one batch on two groups
    "cosmos3 cfg-2": ("cosmos3-nano", 2, dict(cfg_parallel=True)),  # one call per branch, one per group
    "cosmos3 ulysses-2": ("cosmos3-nano", 2, dict(strategy="ulysses")),  # both branches' calls on every rank
    "flux2 ulysses-2": ("flux2-klein-4b", 2, dict(strategy="ulysses")),
    "wan ulysses-2": ("wan2.1-t2v-1.3b", 2, dict(strategy="ulysses")),  # the generic path: 2 x 3 x 5 tokens, padded
}
FIELDS = {
    "tiny-flux": dict(prompt="a big red star in the center on a white background", seed=3, steps=8, height=80,
                      width=112, cache="fbcache:0.25"),
    "tiny-cosmos": dict(prompt="a red circle moving right on a black background", seed=5, steps=8, frames=9,
                        height=48, width=80, cache="fbcache:0.3"),
    "cosmos3-nano": dict(prompt="a red circle moving right", negative_prompt="blurry", seed=7, steps=6, frames=9,
                         height=64, width=96, fps=8, cache="fbcache:0.005"),
    # random weights: its first block's residual changes by more than itself from step to step
    "flux2-klein-4b": dict(prompt="a red circle", seed=2, steps=6, height=80, width=112, cache="fbcache:1.1"),
    "wan2.1-t2v-1.3b": dict(prompt="a red circle moving right", seed=2, steps=8, frames=5, height=48, width=80,
                            cache="fbcache:0.6"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str | None]:
    """Model name -> checkpoint folder (None: the embedded one): tiny random Cosmos 3, FLUX.2 and Wan checkpoints."""
    from pipelines.cosmos3.tiny import cosmos3_components, save_cosmos3
    from pipelines.flux2.tiny import flux2_components, save_flux2
    from pipelines.wan.tiny import save_wan, wan_components

    root = tmp_path_factory.mktemp("cached")
    save_cosmos3(root / "cosmos3", cosmos3_components(seed=3))
    save_flux2(root / "flux2", flux2_components(seed=1, variant="klein"))
    save_wan(root / "wan", wan_components(seed=4))
    return {"tiny-flux": None, "tiny-cosmos": None, "cosmos3-nano": str(root / "cosmos3"),
            "flux2-klein-4b": str(root / "flux2"), "wan2.1-t2v-1.3b": str(root / "wan")}


def _generate(model: str, folder: str | None, options: dict) -> tuple[np.ndarray | None, list[int]]:
    """One request through the app's runtime with a step cache: (the media on rank 0, else None; the steps
    this rank skipped)."""
    from app.ranks.runtime import start_runtime
    from engines.options import RunOptions

    fields = dict(FIELDS[model])
    cache = fields.pop("cache")
    spec, path = resolve_model(model, Path(folder) if folder else None)
    request = make_request(spec, read_limits(spec, path), **fields)
    with start_runtime([(spec, path)], RunOptions(device="cpu", rank_timeout=120, cache=cache, **options),
                       stop=threading.Event()) as runtime:
        assert "cache fbcache" in runtime.backend
        pipeline = runtime.service.pipelines[spec.media]
        if not runtime.is_main:
            runtime.service.follow()
            return None, pipeline.step_caches['transformer'].skipped
        generation = runtime.service.run(spec.media, request)
        assert generation.computed_steps == request.steps - len(pipeline.step_caches['transformer'].skipped)
        return np.asarray(generation.result), pipeline.step_caches['transformer'].skipped


def _rank(rank: int, world_size: int, port: int, case: str, folder: str | None, out: str) -> None:
    join_ranks(rank, world_size, port)
    model, _, options = CASES[case]
    media, skipped = _generate(model, folder, options)
    np.save(f"{out}.skipped{rank}.npy", np.asarray(skipped, dtype=np.int64))
    if media is not None:
        np.save(f"{out}.media.npy", media)


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_skip_the_steps_one_process_skips(case: str, folders: dict, tmp_path: Path) -> None:
    model, world_size, _ = CASES[case]
    single, skipped = _generate(model, folders[model], {})
    assert 0 < len(skipped) < FIELDS[model]["steps"] - 2, f"one process skipped steps {skipped}: no test of skipping"
    out = str(tmp_path / "ranks")
    spawn_ranks(_rank, world_size, case, folders[model], out)
    for rank in range(world_size):
        assert np.load(f"{out}.skipped{rank}.npy").tolist() == skipped, f"rank {rank} skipped other steps"
    parallel = np.load(f"{out}.media.npy").astype(np.int16)
    difference = np.abs(parallel - single.astype(np.int16)).max()
    assert difference <= 1, f"{case} with a step cache differs from one process by {difference} levels"


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

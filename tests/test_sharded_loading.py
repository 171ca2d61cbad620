"""Sharded loading (engines/weights/sharded_loading.py): a tiny Cosmos 3 transformer saved as several safetensors
files, loaded with tp 2 on two gloo ranks. Each rank keeps about half of the parameter bytes, reads
exactly the elements it keeps (split tensors only by their slices, never whole), and the loaded
model, parallelized, gives the output of the whole model in one process. And for every family, what a
rank loads is what splitting the whole model keeps on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import cosmos3_inputs, join_ranks, parallelize, randomize, spawn_ranks, tiny_cosmos3

TOLERANCE = 1e-5
# Four layers: the blocks, which tp splits, outweigh the embedders and norms, which every rank keeps whole.
LAYERS = dict(num_hidden_layers=4)


def _worker(rank: int, world_size: int, port: int, folder: str, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from diffusers import Cosmos3OmniTransformer

    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan
    from engines.weights.sharded_loading import SafetensorsReader, load_split, parameter_bytes
    from pipelines.cosmos3.parallel import cosmos3_weights

    ctx = init_parallel("cpu")
    whole = Cosmos3OmniTransformer.from_pretrained(folder).eval()
    with SafetensorsReader(Path(folder)) as reader:
        model = load_split(Cosmos3OmniTransformer, Path(folder), cosmos3_weights, tp=world_size, rank=rank,
                           dtype=torch.float32, device="cpu", reader=reader)
        stored = {name: reader.shape(name) for name in reader.files}
    split = cosmos3_weights(whole, world_size)
    split_names = {name for name, shape in stored.items()
                   if split.parameter_ranges(name, shape, world_size, rank) is not None}
    whole_reads_of_split = [name for name, shape in reader.reads if name in split_names and shape == stored[name]]
    read_elements = sum(torch.Size(shape).numel() for _, shape in reader.reads)

    torch.manual_seed(1)
    kwargs = cosmos3_inputs(whole, 7, (3, 3, 5))
    with torch.no_grad():
        expected = whole(**kwargs, return_dict=False)[0][0]
        got = parallelize(model, ctx, ParallelPlan(tp=world_size))(**kwargs, return_dict=False)[0][0]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(dict(
        rank_bytes=parameter_bytes(model), whole_bytes=parameter_bytes(whole),
        kept_elements=sum(p.numel() for p in model.parameters()), read_elements=read_elements,
        split_tensors=len(split_names), whole_reads_of_split=whole_reads_of_split,
        err=(got - expected).abs().max().item(), scale=expected.abs().max().item())))
    shutdown(ctx)


def test_tp2_loads_half_the_bytes_by_slices(tmp_path: Path) -> None:
    torch.manual_seed(0)
    folder = tmp_path / "transformer"
    randomize(tiny_cosmos3(**LAYERS)).save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1  # an index and several files
    spawn_ranks(_worker, 2, str(folder), str(tmp_path))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        kept = r["rank_bytes"] / r["whole_bytes"]
        assert 0.5 <= kept < 0.6, f"rank {rank} keeps {kept:.0%} of the parameter bytes"
        assert r["split_tensors"] > 0
        assert r["whole_reads_of_split"] == [], f"rank {rank} read whole tensors it splits: {r['whole_reads_of_split']}"
        assert r["read_elements"] == r["kept_elements"], f"rank {rank} read more than it keeps"
        assert r["scale"] > 0.01 and r["err"] <= TOLERANCE, f"rank {rank}: max error {r['err']:.3g}"


@pytest.mark.parametrize("family", ["flux", "cosmos", "flux2", "cosmos3"])
def test_each_family_loads_the_share_that_splitting_the_whole_model_keeps(family: str, tmp_path: Path) -> None:
    """No process group needed: rank r of tp 4 loaded from safetensors holds exactly what splitting the
    loaded whole model keeps on rank r (packed parts, K/V heads kept by two ranks, row-parallel biases)."""
    import copy

    from engines.parallel.tensor_parallel import split_weights
    from engines.weights.sharded_loading import load_split
    from pipelines.family import load
    from pipelines.registry import FAMILIES
    from tests.test_engines_tensor_parallel import tiny_model

    model = tiny_model(family)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    weights = load(FAMILIES[family].tensor_parallel)
    for rank in (0, 3):
        expected = copy.deepcopy(model)
        split_weights(expected, weights(expected, 4), tp=4, rank=rank)
        loaded = load_split(type(model), tmp_path, weights, tp=4, rank=rank, dtype=torch.float32, device="cpu")
        want, got = expected.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), f"{family} rank {rank}: {name}"
        modules = dict(loaded.named_modules())
        for name, counts in weights(model, 4).head_counts.items():
            assert {attribute: getattr(modules[name], attribute) for attribute in counts} == counts, name

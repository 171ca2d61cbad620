"""Compiled engines (engines.levers.compile) on 2 gloo ranks: inductor == eager, and the engine cache.

Run 1 (cold): tiny FLUX and Cosmos, sharded over 2 ranks (ulysses), compiled per block by inductor
into an empty cache folder (Cosmos with the +overlap reordering); outputs match eager within
inductor's float reassociation error, and each rank writes its artifacts. Run 2 (fresh processes, same folder): the same
FLUX engine finds them (cache hit: inductor's FX graph cache hits, no miss) and builds faster than run 1.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    FLUX_TINY,
    cosmos_inputs,
    flux_inputs,
    join_ranks,
    parallelize,
    randomize,
    spawn_ranks,
    tiny_cosmos,
    tiny_flux,
)

TOLERANCE = 2e-4  # inductor vs eager in float32 (a single process shows ~7e-5 on these outputs)
BLOCKS = {"flux": ("transformer_blocks", "single_transformer_blocks"), "cosmos": ("transformer_blocks",)}


def _worker(rank: int, world_size: int, port: int, out_dir: str, cache_dir: str, models: list[str]) -> None:
    join_ranks(rank, world_size, port)
    from engines.options import run_environment, set_environment

    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    set_environment(run_environment(Path(cache_dir)))  # as the CLI does: inductor's kernels inside the cache folder
    from torch._dynamo.utils import counters

    from engines.levers.compile import prepare_engine
    from engines.options import EngineOptions
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.plan import ParallelPlan

    ctx = init_parallel("cpu")
    results = []
    for name in models:
        torch.manual_seed(0)
        model = randomize(tiny_flux() if name == "flux" else tiny_cosmos())
        torch.manual_seed(1)
        kwargs = flux_inputs((3, 3), 5) if name == "flux" else cosmos_inputs((3, 3, 3))
        parallel = parallelize(model, ctx, ParallelPlan.auto(world_size, 6))
        counters.clear()
        with torch.no_grad():
            eager = parallel(**kwargs)[0]
            # Cosmos with inductor's compute/collective reordering (overlap): same numbers, other graphs.
            options = EngineOptions(backend="inductor", scope="blocks", overlap=name == "cosmos")
            engine = prepare_engine(parallel, options, repeated_blocks=BLOCKS[name], cache_dir=cache_dir)
            first = engine(**kwargs)[0]
            second = engine(**kwargs)[0]
        build = next(iter(engine.builds.values()))
        results.append(dict(
            model=name, err=max((first - eager).abs().max().item(), (second - eager).abs().max().item()),
            hit=build.cache_hit, seconds=build.seconds, saved=str(build.saved) if build.saved else None,
            fx_hit=counters["inductor"]["fxgraph_cache_hit"], fx_miss=counters["inductor"]["fxgraph_cache_miss"],
        ))
        engine.release()
        parallel.restore()
        torch._dynamo.reset()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


def _spawn(out: Path, cache: Path, models: list[str]) -> list[list[dict]]:
    out.mkdir()
    spawn_ranks(_worker, 2, str(out), str(cache), models)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_inductor_engine_matches_eager_and_cache_hit_skips_compile(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cold = _spawn(tmp_path / "cold", cache, ["flux", "cosmos"])
    for rank, rows in enumerate(cold):
        for r in rows:
            assert r["err"] <= TOLERANCE, r
            assert not r["hit"] and r["saved"] and Path(r["saved"]).name == f"rank{rank}.bin", r
            assert r["fx_miss"] > 0, r  # really cold: inductor's own cache is inside the empty cache folder
    keys = {Path(r["saved"]).parent.name for rows in cold for r in rows}
    assert len(keys) == 4  # per model and rank: each rank compiles its own shard offsets
    warm = _spawn(tmp_path / "warm", cache, ["flux"])
    for rank in range(2):
        w, c = warm[rank][0], cold[rank][0]
        assert w["err"] <= TOLERANCE and w["hit"], w
        assert w["fx_hit"] > 0 and w["fx_miss"] == 0, w
        assert w["seconds"] < c["seconds"], (w, c)


def test_cache_key_changes_with_every_component(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.levers import cache as cache_module
    from engines.levers.cache import EngineCache, input_signature
    from engines.options import EngineOptions

    store = EngineCache(Path("/nonexistent"))
    model = tiny_flux()
    kwargs = flux_inputs((3, 3), 5)
    sig = input_signature(kwargs)
    opts = EngineOptions(backend="inductor")
    base = store.key(model, sig, opts, 0)
    assert store.key(model, sig, opts, 0) == base  # deterministic
    other_config = type(model)(**{**FLUX_TINY, "num_single_layers": 2})
    variants = {
        "config": store.key(other_config, sig, opts, 0),
        "dtype": store.key(tiny_flux().to(torch.bfloat16), sig, opts, 0),
        "shape": store.key(model, input_signature(flux_inputs((3, 4), 5)), opts, 0),
        "stride": store.key(model, input_signature({**kwargs, "timestep": kwargs["timestep"][:1].expand(2)}), opts, 0),
        "backend": store.key(model, sig, EngineOptions(backend="inductor", scope="blocks"), 0),
        "cudagraph": store.key(model, sig, EngineOptions(backend="eager", cuda_graph=True), 0),
        "overlap": store.key(model, sig, EngineOptions(backend="inductor", overlap=True), 0),
        "rank": store.key(model, sig, opts, 1),
    }

    class FakeMesh:
        from engines.parallel.plan import ParallelPlan

        plan = ParallelPlan(strategy="ring", ring=2)

    class Wrapped(torch.nn.Module):  # a ParallelTransformer-like shell carrying a plan
        def __init__(self) -> None:
            super().__init__()
            self.model, self.mesh = model, FakeMesh()
            self.device, self.dtype = model.device, model.dtype

    variants["plan"] = store.key(Wrapped(), sig, opts, 0)
    copy_engine = Wrapped()
    copy_engine.mesh = type("CopyEngineMesh", (FakeMesh,), {"all_to_all": "copy-engine"})()
    variants["all_to_all"] = store.key(copy_engine, sig, opts, 0)
    versions = cache_module.library_versions()
    monkeypatch.setattr(cache_module, "library_versions", lambda: {**versions, "torch": "0.0.0"})
    variants["versions"] = store.key(model, sig, opts, 0)
    assert base not in variants.values(), variants
    assert len(set(variants.values())) == len(variants), variants


def test_engine_options_validate_and_round_trip() -> None:
    from app.commands.arguments import backend_label
    from engines.levers.compile import prepare_engine
    from engines.options import EngineOptions

    for label in ("eager", "inductor", "inductor-blocks", "inductor+cudagraph", "eager+cudagraph", "tensorrt",
                  "tensorrt-blocks", "inductor-blocks+overlap+cudagraph", "inductor-blocks+overlap"):
        assert EngineOptions.parse(label).label == label
        assert backend_label(label) == label  # the CLI's torch-free check accepts every engine label
    with pytest.raises(ValueError, match="unknown backend"):
        EngineOptions(backend="xla")
    with pytest.raises(ValueError, match="overlap applies"):
        EngineOptions.parse("eager+overlap")
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineOptions.parse("inductor+fast")
    for removed in ("inductor-blocks-max-autotune-no-cudagraphs", "inductor-reduce-overhead", "eager-blocks"):
        with pytest.raises(ValueError):  # modes measured slower or never faster (docs/benchmarks.md)
            EngineOptions.parse(removed)
        with pytest.raises(argparse.ArgumentTypeError):
            backend_label(removed)
    with pytest.raises(ValueError, match="no repeated blocks"):
        prepare_engine(tiny_flux(), EngineOptions.parse("inductor-blocks"))
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA"):
        prepare_engine(tiny_flux(), EngineOptions(cuda_graph=True))


def test_tensorrt_backend() -> None:
    from engines.levers.compile import BackendUnavailable, prepare_engine, tensorrt_available
    from engines.options import EngineOptions

    model = randomize(tiny_flux())
    if not tensorrt_available():
        with pytest.raises(BackendUnavailable, match="torch-tensorrt"):
            prepare_engine(model, EngineOptions(backend="tensorrt"))
        pytest.skip("torch-tensorrt with TensorRT's native libraries is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT engines need a CUDA GPU")
    model = model.cuda()
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in flux_inputs((3, 3), 5).items()}
    with torch.no_grad():
        ref = model(**kwargs)[0]
        out = prepare_engine(model, EngineOptions(backend="tensorrt"))(**kwargs)[0]
    assert (out - ref).abs().max().item() <= 1e-2

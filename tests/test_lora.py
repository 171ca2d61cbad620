"""LoRA adapters (engines/weights/lora.py) on tiny-flux's transformer: formats, scales, diffusers' own loader as the
reference, gloo ranks (every strategy on 2 and 4 ranks, tp 2, ulysses 2 x tp 2), the check before any rank starts, no
recompilation when the choice changes (compiled blocks, and a compiled one-process server switching three LoRAs), and
the engine cache key (LoRA layout, not weights).

The LoRAs are made here: random A/B (fixed seeds, rank 4, 2 and 3) on every linear of the double-stream blocks (their
modulation included) and the single-stream blocks' proj_out, saved in diffusers/PEFT keys, and a kohya copy written
by engines.weights.lora.export_kohya. The single-stream blocks' q/k/v and proj_mlp are left out: kohya fuses them into
one layer (linear1) that diffusers' converter splits by FLUX.1-dev's widths, which tiny-flux does not have.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, import_noise, join_ranks, run_app, spawn_ranks

TINY_FLUX = REPO / "assets" / "tiny-flux"
TOLERANCE = 1e-5
DOUBLE = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
          "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
          "ff_context.net.2", "norm1.linear", "norm1_context.linear")


def transformer() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(TINY_FLUX / "transformer").eval()


def make_lora(path: Path, seed: int, rank: int) -> Path:
    """A random LoRA for tiny-flux in diffusers/PEFT keys (no alphas: scale 1), saved with safetensors."""
    from safetensors.torch import save_file

    model = transformer()
    generator = torch.Generator().manual_seed(seed)
    state = {}
    names = [f"transformer_blocks.{i}.{layer}" for i in range(len(model.transformer_blocks)) for layer in DOUBLE]
    names += [f"single_transformer_blocks.{i}.proj_out" for i in range(len(model.single_transformer_blocks))]
    for name in names:
        layer = model.get_submodule(name)
        state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=generator) * 0.1
        state[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator) * 0.1
    save_file(state, str(path))
    return path


def inputs(batch: int = 1, text: int = 5, grid: tuple[int, int] = (3, 4), seed: int = 1) -> dict:
    """One call of tiny-flux's transformer (token counts that 2 does not divide)."""
    generator = torch.Generator().manual_seed(seed)
    h, w = grid
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(batch, h * w, 16, generator=generator),
                encoder_hidden_states=torch.randn(batch, text, 64, generator=generator),
                pooled_projections=torch.randn(batch, 32, generator=generator),
                timestep=torch.rand(batch, generator=generator), img_ids=img_ids.reshape(-1, 3),
                txt_ids=torch.zeros(text, 3), guidance=torch.full((batch,), 3.5), return_dict=False)


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import load_file

    from engines.weights.lora import export_kohya

    folder = tmp_path_factory.mktemp("loras")
    files = {"a": make_lora(folder / "a.safetensors", seed=0, rank=4), "b": make_lora(folder / "b.safetensors", 1, 2),
             "c": make_lora(folder / "c.safetensors", 2, 3)}
    files["a_kohya"] = export_kohya(load_file(str(files["a"])), folder / "a_kohya.safetensors")
    return files


def adapted(files: dict[str, Path], *, split=None, tp: int = 1, rank: int = 0) -> tuple[torch.nn.Module, object]:
    from engines.weights.lora import LoraFile, attach_loras, check_lora_files

    model = transformer()
    weights = check_lora_files([LoraFile(name=name, path=path) for name, path in files.items()], type(model),
                               dict(model.config))
    return model, attach_loras(model, weights, dtype=torch.float32, split=split, tp=tp, rank=rank)


def test_kohya_copy_gives_the_same_output_and_scale_zero_is_no_lora(loras) -> None:
    import safetensors

    with safetensors.safe_open(str(loras["a_kohya"]), "pt") as f:
        assert any(key.startswith("lora_unet_double_blocks_0_img_attn_qkv") for key in f.keys())
    model, chosen = adapted({"a": loras["a"], "a_kohya": loras["a_kohya"]})
    kwargs = inputs()
    with torch.no_grad():
        plain = transformer()(**kwargs)[0]
        chosen.select([])
        none = model(**kwargs)[0]
        chosen.select([("a", 0.0)])
        zero = model(**kwargs)[0]
        chosen.select([("a", 0.8)])
        diffusers_format = model(**kwargs)[0]
        chosen.select([("a_kohya", 0.8)])
        kohya = model(**kwargs)[0]
    assert torch.equal(none, plain) and torch.equal(zero, plain)
    assert (diffusers_format - plain).abs().max() > 1e-3  # the LoRA does something
    assert (kohya - diffusers_format).abs().max() <= TOLERANCE


def test_matches_diffusers_load_lora_weights_and_set_adapters(loras) -> None:
    pytest.importorskip("peft")
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(TINY_FLUX)
    pipe.load_lora_weights(str(loras["a"]), adapter_name="a")
    pipe.load_lora_weights(str(loras["b"]), adapter_name="b")
    model, chosen = adapted({"a": loras["a"], "b": loras["b"]})
    kwargs = inputs(batch=2)
    with torch.no_grad():
        for choice in ([("a", 0.7)], [("a", 0.7), ("b", -0.4)], [("b", 1.3)]):
            names, weights = zip(*choice)
            pipe.set_adapters(list(names), list(weights))
            expected = pipe.transformer(**kwargs)[0]
            chosen.select(choice)
            got = model(**kwargs)[0]
            assert (got - expected).abs().max() <= TOLERANCE, choice


def test_fp8_fused_projections_take_the_lora_on_their_rows(loras) -> None:
    """--fp8 fuses q/k/v (to_qkv): each LoRA lands on its projection's rows; the FP8 GEMM beside it is unchanged."""
    from engines.levers.fp8 import fuse_shared_input_projections

    reference, chosen_ref = adapted({"a": loras["a"]})
    model = transformer()
    fuse_shared_input_projections(model, ("transformer_blocks", "single_transformer_blocks"))
    from engines.weights.lora import LoraFile, attach_loras, check_lora_files

    weights = check_lora_files([LoraFile(name="a", path=loras["a"])], type(model), dict(transformer().config))
    chosen = attach_loras(model, weights, dtype=torch.float32)
    kwargs = inputs()
    with torch.no_grad():
        chosen_ref.select([("a", 1.0)])
        chosen.select([("a", 1.0)])
        assert (model(**kwargs)[0] - reference(**kwargs)[0]).abs().max() <= TOLERANCE


def test_a_file_that_does_not_fit_is_refused_naming_its_first_bad_key(loras, tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file, save_file

    from engines.weights.lora import LoraError, LoraFile, check_lora_files

    config = json.loads((TINY_FLUX / "transformer" / "config.json").read_text())
    state = load_file(str(loras["a"]))
    wrong_shape = dict(state)
    key = "transformer.transformer_blocks.1.ff.net.2.lora_B.weight"
    wrong_shape[key] = torch.zeros(7, 4)
    save_file(wrong_shape, str(tmp_path / "shape.safetensors"))
    with pytest.raises(LoraError, match=f"key {key}: shape \\(7, 4\\), the layer .* takes \\(128, 4\\)"):
        check_lora_files([LoraFile(name="x", path=tmp_path / "shape.safetensors")], FluxTransformer2DModel, config)
    missing = {"transformer.transformer_blocks.9.attn.to_q.lora_A.weight": torch.zeros(4, 128), **state}
    save_file(missing, str(tmp_path / "module.safetensors"))
    with pytest.raises(LoraError, match="key transformer.transformer_blocks.9.attn.to_q.lora_A.weight: the "
                                        "transformer has no linear layer transformer_blocks.9.attn.to_q"):
        check_lora_files([LoraFile(name="x", path=tmp_path / "module.safetensors")], FluxTransformer2DModel, config)
    with pytest.raises(LoraError, match="no LoRA loader for Cosmos3OmniTransformer"):
        from diffusers import Cosmos3OmniTransformer

        from pipelines.cosmos3.tiny import COSMOS3_TINY_TRANSFORMER

        check_lora_files([LoraFile(name="x", path=loras["a"])], Cosmos3OmniTransformer, COSMOS3_TINY_TRANSFORMER)


def test_lora_option_parses_name_path_and_scale() -> None:
    from engines.weights.lora import LoraError, LoraFile

    assert LoraFile.parse("style=/x/s.safetensors:0.8") == LoraFile(name="style", path=Path("/x/s.safetensors"),
                                                                     scale=0.8)
    assert LoraFile.parse("s=c:/x.safetensors").scale == 1.0
    for bad in ("nopath", "a b=x", "s=x:99"):
        with pytest.raises(LoraError):
            LoraFile.parse(bad)


def test_switching_loras_and_scales_compiles_nothing_more(loras) -> None:
    counted = []

    def backend(graph, example_inputs):
        counted.append(graph)
        return graph.forward

    model, chosen = adapted({"a": loras["a"], "b": loras["b"]})
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for block in blocks:
            block.compile(backend=backend, fullgraph=True, dynamic=False)
    kwargs = inputs()
    torch._dynamo.reset()
    with torch.no_grad():
        chosen.select([("a", 1.0)])
        first = model(**kwargs)[0]
        built = len(counted)
        outs = []
        for choice in ([("b", 0.5)], [], [("a", 0.3), ("b", -1.0)], [("a", 1.0)]):
            chosen.select(choice)
            outs.append(model(**kwargs)[0])
    assert built > 0 and len(counted) == built
    assert torch.equal(outs[-1], first) and not torch.equal(outs[0], first)


def test_the_engine_cache_key_follows_the_loras_layout_not_their_weights_or_scales(loras, tmp_path: Path) -> None:
    """A compiled graph depends on which layers carry a LoRA term and its rank slots (LoRAs x r_max): the engine
    cache's key changes with those and stays for other weights (same rank and layers) or other scales."""
    from safetensors.torch import load_file, save_file

    from engines.levers.cache import EngineCache, input_signature
    from engines.options import EngineOptions

    store, options = EngineCache(tmp_path), EngineOptions(backend="inductor", scope="blocks")
    signature = input_signature(inputs())

    def key(files: dict[str, Path], choice=()) -> str:
        model, chosen = adapted(files) if files else (transformer(), None)
        if chosen is not None:
            chosen.select(choice)
        return store.key(model, signature, options, 0)

    state = load_file(str(loras["a"]))
    save_file({k: v for k, v in state.items() if ".single_transformer_blocks." not in k}, str(tmp_path / "fewer.st"))
    a = key({"a": loras["a"]})
    assert len({key({}), a, key({"b": loras["b"]}), key({"a": loras["a"], "b": loras["b"]}),
                key({"a": tmp_path / "fewer.st"})}) == 5  # none, rank 4, rank 2, two LoRAs, fewer layers
    other = make_lora(tmp_path / "other.safetensors", seed=7, rank=4)
    assert key({"a": other}) == a == key({"a": loras["a"]}, [("a", 0.3)]) == key({"x": loras["a"]}, [("x", -1.0)])


def test_a_compiled_server_switches_three_loras_over_six_requests_without_recompiling(loras, tmp_path: Path) -> None:
    """The serving path (app.ranks.runtime.start_runtime's one-process runtime, `--backend inductor-blocks`, `--lora
    a=.. b=.. c=..`): six requests of one shape that switch LoRAs and scales (none included) compile at the first
    request only, and the LoRA chosen shows in the image."""
    import threading

    import numpy as np
    import torch._dynamo

    from app.ranks.runtime import start_runtime
    from engines.options import LoraFile, RunOptions
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request

    spec, folder = resolve_model("tiny-flux", None)
    options = RunOptions(device="cpu", rank_timeout=120, backend="inductor-blocks", engine_cache=tmp_path,
                         loras=tuple(LoraFile(name=name, path=loras[name]) for name in ("a", "b", "c")))
    choices = ("a:1", "b:0.5", "", "c:1", "a:0.3,c:-1", "a:1")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    images, graphs = [], []
    with start_runtime([(spec, folder)], options, stop=threading.Event()) as runtime:
        limits = runtime.models["image"].limits
        assert [name for name, _ in limits.loras] == ["a", "b", "c"]
        for choice in choices:
            request = make_request(spec, limits, prompt="a red circle", seed=3, steps=2, height=64, width=64,
                                   lora=choice)
            images.append(np.asarray(runtime.service.run("image", request).result).astype(np.int16))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == graphs[:1] * len(choices), graphs
    first, *others = images
    for other in others[:-1]:  # b, none, c, a and c mixed: each its own image
        assert np.abs(other - first).max() > 8
    assert len({other.tobytes() for other in others[:-1]}) == len(others) - 1
    assert np.abs(others[-1] - first).max() <= 1  # a at 1 again: the first image


def lora_plans(world_size: int) -> list:
    """Every strategy on `world_size` ranks, and tp (tiny-flux has 4 heads)."""
    from engines.parallel.plan import ParallelPlan

    plans = [ParallelPlan.auto(world_size, 4, strategy=s) for s in ("ulysses", "ring", "allgather")]
    return plans + [ParallelPlan(tp=2) if world_size == 2 else ParallelPlan(ulysses=2, tp=2)]


def _worker(rank: int, world_size: int, port: int, out_dir: str, files: dict[str, str]) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.tensor_parallel import split_weights
    from pipelines.flux.parallel import flux_weights
    from tests.helpers import parallelize

    ctx = init_parallel("cpu")
    paths = {name: Path(path) for name, path in files.items()}
    kwargs = inputs(batch=2)
    choice = [("a", 0.9), ("b", -0.5)]
    results = {}
    with torch.no_grad():
        reference, chosen = adapted(paths)
        chosen.select(choice)
        expected = reference(**kwargs)[0]
        for plan in lora_plans(world_size):
            model = transformer()
            tp_rank = rank % plan.tp  # tp is the innermost axis (engines.parallel.mesh)
            if plan.tp > 1:  # loaded split as the app does: split first, then the LoRA on the shards
                split_weights(model, flux_weights(model, plan.tp), tp=plan.tp, rank=tp_rank)
            model, chosen = adapted_model(model, paths,
                                          split=flux_weights(transformer(), plan.tp) if plan.tp > 1 else None,
                                          tp=plan.tp, rank=tp_rank)
            parallel = parallelize(model, ctx, plan)
            chosen.select(choice)
            got = parallel(**kwargs)[0]
            results[plan.label] = (got - expected).abs().max().item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


def adapted_model(model, files, **split):
    from engines.weights.lora import LoraFile, attach_loras, check_lora_files

    weights = check_lora_files([LoraFile(name=name, path=path) for name, path in files.items()], type(model),
                               dict(model.config))
    return model, attach_loras(model, weights, dtype=torch.float32, **split)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_ranks_every_strategy_and_tp_match_one_process(world_size: int, loras, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path), {name: str(loras[name]) for name in ("a", "b")})
    for rank in range(world_size):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(errors) == len(lora_plans(world_size))
        for plan, error in errors.items():
            assert error <= TOLERANCE, (rank, plan, error)


def test_generate_and_batch_use_the_requests_loras_and_record_them(loras, tmp_path: Path) -> None:
    from PIL import Image

    from pipelines.media import read_png_settings

    common = ("--model", "tiny-flux", "--steps", "2", "--size", "64x64", "--device", "cpu",
              "--lora", f"a={loras['a']}:0.8", "--lora", f"b={loras['b']}")
    result = run_app("generate", "--prompt", "a red circle", "--out", str(tmp_path / "one.png"), *common)
    assert result.returncode == 0, result.stderr
    assert not import_noise(result.stderr), result.stderr  # the check step reads the files before any rank starts
    assert read_png_settings(tmp_path / "one.png")["lora"] == {"a": 0.8, "b": 1.0}  # none chosen: every --lora
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "a red circle", "name": "plain", "lora": ""},
        {"prompt": "a red circle", "name": "a", "lora": "a:0.8"},
        {"prompt": "a red circle", "name": "bad", "lora": "c"})) + "\n")
    result = run_app("batch", str(prompts), "--out", str(tmp_path / "batch"), *common)
    assert "LoRA 'c' is not loaded in this run for tiny-flux; tiny-flux has: a, b" in result.stdout + result.stderr
    manifest = [json.loads(line) for line in (tmp_path / "batch" / "manifest.jsonl").read_text().splitlines()]
    settings = {entry["file"]: entry["settings"] for entry in manifest}
    assert "lora" not in settings["plain.png"] and settings["a.png"]["lora"] == {"a": 0.8}
    with Image.open(tmp_path / "batch" / "plain.png") as plain, Image.open(tmp_path / "batch" / "a.png") as adapted:
        assert plain.tobytes() != adapted.tobytes()


def test_the_check_step_refuses_a_file_naming_its_first_bad_key(loras, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(loras["a"]))
    key = "transformer.single_transformer_blocks.2.proj_out.lora_A.weight"
    state[key] = torch.zeros(4, 5)
    save_file(state, str(tmp_path / "bad.safetensors"))
    result = run_app("generate", "--model", "tiny-flux", "--prompt", "x", "--device", "cpu", "--out",
                  str(tmp_path / "x.png"), "--lora", f"bad={tmp_path / 'bad.safetensors'}")
    assert result.returncode == 2 and f"key {key}: shape (4, 5)" in result.stderr, result.stderr
    assert "denoising" not in result.stderr


def test_serve_refuses_a_file_that_fits_none_of_its_models(loras) -> None:
    """serve attaches a file to the served models it fits (tests/test_app_serve.py's server: tiny-flux of the
    default pair); one that fits none stops the start, each model saying why."""
    from tests.helpers import free_port

    result = run_app("serve", "--model", "tiny-cosmos", "--device", "cpu", "--port", str(free_port()),
                  "--lora", f"a={loras['a']}")
    assert result.returncode == 2, result.stderr
    assert "--lora a fits none of the served models (tiny-cosmos: " in result.stderr
    assert "the transformer has no linear layer" in result.stderr and "denoising" not in result.stderr
    assert not import_noise(result.stderr), result.stderr


def test_the_ui_turns_its_lora_inputs_into_the_request_field_and_back() -> None:
    """A tab's LoRA choice (names, one scale) as make_request's lora field; a recent result's LoRAs back into them."""
    import gradio as gr

    from app.server.ui import _lora_field, _restored_loras

    assert _lora_field(None, 0.8) == () and _lora_field([], 0.8) == ()
    assert _lora_field(["a", "b"], 0.5) == [["a", 0.5], ["b", 0.5]] and _lora_field("a", None) == ["a"]
    slider = gr.Slider(minimum=0, maximum=2, value=0.8)
    assert _restored_loras({"lora": {"a": 0.3}}, slider) == (["a"], 0.3)
    assert _restored_loras({}, slider) == ([], 0.8) and _restored_loras({"lora": {"a": 0.3}}, None) == ()

"""FLUX.3 through our pipeline, beyond its equality with diffusers' modular pipelines (tests/test_conformance.py):
the limits read from its configs, a folder alone names its model, and every block list compiles and goes FP8.

The checkpoints are pipelines.flux3.tiny' FLUX.3 folders: a 32-layer, 8-wide Qwen3-VL under a word-level Qwen
tokenizer, the FLUX.2 VAE shrunk, a 12-head transformer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a big red circle on the left"


def _folder(tmp_path_factory, distilled: bool) -> Path:
    from pipelines.flux3.tiny import flux3_components, save_flux3

    path = tmp_path_factory.mktemp("flux3") / ("flux-3-image-klein" if distilled else "flux-3-image-klein-base")
    save_flux3(path, flux3_components(seed=1, distilled=distilled))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory, distilled=False)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory, distilled=True)


def test_limits_from_the_configs(base: Path, distilled: Path) -> None:
    spec, path = resolve_model("flux3-klein-base", base)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.max_height, limits.reference_image) == (16, 4096, True)
    assert read_limits(spec, path, cfg_parallel=True).guidance_split  # the base model: its two calls, one per group
    flow_map, flow_map_path = resolve_model("flux3-klein", distilled)
    assert not read_limits(flow_map, flow_map_path, cfg_parallel=True).guidance_split  # no guidance
    # its guider runs guidance at every scale but 1 (below 1 too), so --cfg-parallel takes 0.5 and refuses 1 alone
    split = read_limits(spec, path, cfg_parallel=True)
    assert make_request(spec, split, prompt=PROMPT, guidance=0.5).guidance == 0.5
    with pytest.raises(RequestError, match="guidance must be other than 1 here"):
        make_request(spec, split, prompt=PROMPT, guidance=1.0)
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)


def test_folder_alone_names_its_model(base: Path, distilled: Path) -> None:
    assert resolve_model(None, base)[0].name == "flux3-klein-base"
    assert resolve_model(None, distilled)[0].name == "flux3-klein"


def test_every_block_list_compiles_and_goes_fp8_one_block_at_a_time() -> None:
    """FLUX.3's per-mode blocks (text, image, reference image) compile and go FP8 one block at a time like its joint
    blocks (the family's compiled_blocks, reached by dotted paths into mode_blocks); the step cache keeps looping
    over the joint blocks alone. The compiled engine equals eager."""
    from diffusers import Flux3Transformer2DModel

    from engines.levers.compile import prepare_engine
    from engines.levers.fp8 import fp8_linear_names
    from engines.options import EngineOptions
    from pipelines.families import FLUX3
    from pipelines.flux3.inputs import flux3_inputs
    from pipelines.flux3.tiny import FLUX3_TINY_TRANSFORMER
    from pipelines.transformer_inputs import Shape

    assert FLUX3.repeated_blocks == ("single_transformer_blocks",)
    torch.manual_seed(0)
    model = Flux3Transformer2DModel(**FLUX3_TINY_TRANSFORMER).eval()
    kwargs, _ = flux3_inputs(FLUX3_TINY_TRANSFORMER, Shape(height=32, width=32, text_tokens=6), batch=1,
                             device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)  # a 2x2-token reference image at l = 1
    kwargs["image_cond_hidden_states"] = torch.randn(1, 4, FLUX3_TINY_TRANSFORMER["cond_in_channels"], generator=g)
    kwargs["image_cond_ids"] = torch.tensor([[0, r, c, 1] for r in (0, 1) for c in (0, 1)], dtype=torch.float32)
    with torch.no_grad():
        eager = model(**kwargs)[0]
        engine = prepare_engine(model, EngineOptions.parse("inductor-blocks"), repeated_blocks=FLUX3.compiled_blocks)
        compiled = engine(**kwargs)[0]
    lists = {name: len(model.get_submodule(name)) for name in FLUX3.compiled_blocks}
    assert lists == {"single_transformer_blocks": 2, "txt_mode_blocks": 2, "mode_blocks.image": 2,
                     "mode_blocks.image_cond": 2}
    assert len(engine._swapped) == sum(lists.values())  # every block of every list compiled on its own
    assert (compiled - eager).abs().max().item() < 2e-4
    engine.release()
    quantized = fp8_linear_names(model, FLUX3.compiled_blocks)
    for name in FLUX3.compiled_blocks:
        assert any(layer.startswith(f"{name}.") for layer in quantized), name


def test_work_counts_the_guidance_calls_the_pipeline_makes(base: Path, distilled: Path) -> None:
    """The base model's guidance is two calls, counted twice (below 1 as above: its guider is on at every scale
    but 1); the distilled (flow-map) model makes one call whatever a request's guidance, so its work is one call's."""
    from pipelines.work import WorkCounter

    for name, folder, calls in (("flux3-klein-base", base, 2), ("flux3-klein", distilled, 1)):
        spec, path = resolve_model(name, folder)
        limits = read_limits(spec, path)
        count = WorkCounter(spec, path, limits)
        guided, below_1, plain = (count(make_request(spec, limits, prompt=PROMPT, height=64, width=48,
                                                     guidance=guidance)) for guidance in (3.5, 0.5, 1.0))
        assert guided.step_flops == pytest.approx(calls * plain.step_flops, rel=1e-6), name
        assert below_1.step_flops == guided.step_flops, name


def test_a_rank_without_the_vae_reads_its_factor_from_the_folder(base: Path, tmp_path: Path) -> None:
    """Ranks > 0 load no VAE, yet make the latent grid every rank shares: its factor comes from the folder's VAE config
    (as the limits read it), not from an assumed 8x."""
    import json
    import shutil

    from pipelines.factory import load_pipeline

    folder = tmp_path / "flux-3-image-klein-base"
    shutil.copytree(base, folder)
    config_path = folder / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    config["block_out_channels"] = config["block_out_channels"][:3]  # a 4x VAE
    config_path.write_text(json.dumps(config))
    spec, path = resolve_model("flux3-klein-base", folder)
    pipeline = load_pipeline(spec, path, with_encoders=False)
    assert pipeline.vae is None
    assert pipeline.vae_scale_factor * 2 == read_limits(spec, path).size_multiple == 8

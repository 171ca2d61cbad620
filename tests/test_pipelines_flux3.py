"""FLUX.3 through our pipeline: equal to diffusers' modular pipeline (Flux3ModularPipeline, and
Flux3DistilledModularPipeline for a flow map) on tiny random checkpoints saved as diffusers saves them, with
classifier-free guidance (two calls) and without, distilled, and with a reference image; the limits read from
its configs. Measured on CPU in float32: latents and images are bit for bit diffusers'; the bounds below leave
room for other kernels.

The checkpoints are pipelines.flux3.tiny' FLUX.3 folders: a 32-layer, 8-wide Qwen3-VL under a word-level Qwen
tokenizer, the FLUX.2 VAE shrunk, a 12-head transformer. diffusers' prompt upsampler is popped from its blocks
(we do not offer it), and its pipeline is given the tokenizer as ours uses it (pipelines.flux3.ChatTokenizer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.factory import load_pipeline
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


def request(name: str, folder: Path, **fields):
    spec, path = resolve_model(name, folder)
    fields = {"prompt": PROMPT, "seed": 7, "steps": 2, "height": 64, "width": 48, **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def diffusers_run(path: Path, req) -> tuple[torch.Tensor, Image.Image]:
    """diffusers' modular pipeline on the same request (no prompt upsampling): its final latents, unpacked to
    [1, C, h, w], and its image."""
    from diffusers import ModularPipeline
    from diffusers.guiders import ClassifierFreeGuidance

    from pipelines.flux3.pipeline import as_processor

    blocks = ModularPipeline.from_pretrained(str(path)).blocks
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(path))
    pipe.load_components(dtype=torch.float32)
    pipe.update_components(tokenizer=as_processor(pipe.tokenizer))
    inputs = dict(prompt=req.prompt, height=req.height, width=req.width, num_inference_steps=req.steps,
                  generator=torch.Generator().manual_seed(req.seed), max_sequence_length=512)
    if "guider" in pipe.component_names:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=req.guidance))
        inputs["negative_prompt"] = req.negative_prompt
    if req.condition is not None:
        inputs["image"] = Image.open(req.condition).convert("RGB")
    out = pipe(**inputs, output=["images", "latents"])
    return out["latents"], out["images"][0]


def check_equal(name: str, folder: Path, **fields) -> object:
    spec, path, req = request(name, folder, **fields)
    pipeline = load_pipeline(spec, path)
    cond = pipeline.encode(req)
    ours = pipeline.denoise(req, cond)
    latents, image = diffusers_run(path, req)
    rows, cols = req.height // 16, req.width // 16
    ours_grid = ours.reshape(1, rows, cols, -1).permute(0, 3, 1, 2)
    assert ours_grid.shape == latents.shape
    assert (ours_grid - latents).abs().max().item() < 1e-5
    result = pipeline.decode(req, ours)
    assert result.size == (req.width, req.height)
    assert np.abs(np.asarray(result, np.int16) - np.asarray(image, np.int16)).max() <= 1
    return cond


@pytest.mark.parametrize("guidance", [3.5, 1.0])
def test_base_equals_diffusers(base: Path, guidance: float) -> None:
    cond = check_equal("flux3-klein-base", base, guidance=guidance, negative_prompt="blurry")
    assert (cond.negative_embeds is not None) == (guidance != 1.0)
    assert cond.prompt_embeds.shape[1] % 80 == 0  # the window padded to a multiple of 80 tokens


def test_distilled_equals_diffusers(distilled: Path) -> None:
    cond = check_equal("flux3-klein", distilled, guidance=1.0)
    assert cond.negative_embeds is None


def test_reference_image_equals_diffusers(base: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference.png"
    pixels = np.random.default_rng(0).integers(0, 256, (72, 88, 3), dtype=np.uint8)  # reflect-padded to 80 x 96
    Image.fromarray(pixels).save(reference)
    cond = check_equal("flux3-klein-base", base, guidance=3.5, condition=str(reference))
    assert cond.reference_latents.shape[1] == (80 // 16) * (96 // 16) and cond.reference_ids[0, 3] == -1


def test_limits_from_the_configs(base: Path, distilled: Path) -> None:
    spec, path = resolve_model("flux3-klein-base", base)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.max_height, limits.reference_image) == (16, 4096, True)
    assert read_limits(spec, path, cfg_parallel=True).guidance_split  # the base model: its two calls, one per group
    flow_map, flow_map_path = resolve_model("flux3-klein", distilled)
    assert not read_limits(flow_map, flow_map_path, cfg_parallel=True).guidance_split  # no guidance
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

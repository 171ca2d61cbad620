"""A model family is one record: one registered here, from a tiny config, runs through `generate`.

The family "toy" below exists only in this file. Its record names existing code (the FLUX-style
pipeline and engines adapter: a new family would name its own modules), a transformer config of
its own and a checkpoint of its own; nothing else in the tree knows it. `generate` then runs it at
1 and 2 gloo ranks (Ulysses and all-gather), and the images agree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipelines.family import BenchShapes, ModelFamily, ModelSpec
from pipelines.registry import ASSETS_DIR
from tests.helpers import join_ranks, spawn_ranks

TOY_TRANSFORMER = dict(  # 6 heads (2 and 3 ranks split them); widths fit the embedded tiny-flux encoders and VAE
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=6,
    joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
TOY = ModelFamily(
    name="toy",
    title="Toy-style",
    transformer="diffusers:FluxTransformer2DModel",
    pipeline="pipelines.flux.pipeline:FluxImagePipeline",
    parallelize="pipelines.flux.parallel:parallelize_flux",
    tensor_parallel="pipelines.flux.parallel:flux_weights",
    repeated_blocks=("transformer_blocks", "single_transformer_blocks"),
    block_outputs=(("encoder_hidden_states", "hidden_states"), ("encoder_hidden_states", "hidden_states")),
    cache_stream="hidden_states",
    limits="pipelines.flux.limits:flux_limits",
    guidance_batch=False,
    bench=BenchShapes(inputs="pipelines.flux.inputs:flux_inputs", sizes=("64x64",), tiny_sizes=("64x64",)),
    models=(ModelSpec(name="toy-tiny", family="toy", media="image", checkpoint_class="FluxPipeline", folder="toy-tiny",
                      source="made by tests/test_families.py", height=48, width=80, steps=2, guidance=3.5,
                      max_sequence_length=16),),
)


def register_toy() -> None:
    from pipelines.registry import FAMILIES, register_family

    if TOY.name not in FAMILIES:
        register_family(TOY)


def write_toy_checkpoint(folder: Path) -> Path:
    """A diffusers folder: the embedded tiny-flux's encoders, VAE and scheduler, and a new transformer."""
    from diffusers import FluxTransformer2DModel

    embedded = ASSETS_DIR / "tiny-flux"
    for part in ("scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        shutil.copytree(embedded / part, folder / part)
    shutil.copy(embedded / "model_index.json", folder / "model_index.json")
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**TOY_TRANSFORMER)
    with torch.no_grad():
        for p in transformer.parameters():  # diffusers zero-initialises the gates: random values draw something
            p.normal_(0.0, 0.1)
    transformer.save_pretrained(folder / "transformer")
    return folder


def _generate(rank: int, world_size: int, port: int, folder: str, strategy: str, out: str) -> None:
    join_ranks(rank, world_size, port)
    register_toy()  # each rank is a new process: the registration is the test's, not the tree's
    from app.commands.cli import main

    status = main(["generate", "--model", "toy-tiny", "--model-path", folder, "--prompt", "a red circle",
                   "--seed", "5", "--strategy", strategy, "--quiet", "--out", out])
    assert status == 0


def test_a_registered_family_runs_through_generate_at_1_and_2_ranks(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pipelines import registry

    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))  # leave the process's registry as it was
    monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
    register_toy()
    assert registry.get_spec("toy-tiny").family == "toy"
    folder = write_toy_checkpoint(tmp_path / "toy-tiny")

    images = {}
    for ranks, strategy in ((1, "ulysses"), (2, "ulysses"), (2, "allgather")):
        out = tmp_path / f"{ranks}-{strategy}.png"
        spawn_ranks(_generate, ranks, str(folder), strategy, str(out))
        images[ranks, strategy] = np.asarray(Image.open(out)).astype(np.int16)
    single = images[1, "ulysses"]
    assert single.shape == (48, 80, 3) and single.std() > 1  # drawn at the record's default size
    for key, image in images.items():
        assert np.abs(image - single).max() <= 1, f"{key[0]} ranks, {key[1]}"


def test_a_family_whose_checkpoint_names_another_family_is_refused() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="names family 'flux', not 'toy'"):
        replace(TOY, models=(replace(TOY.models[0], family="flux"),))


def test_a_name_is_registered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from pipelines import registry

    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    monkeypatch.setattr(registry, "MODELS", dict(registry.MODELS))
    with pytest.raises(ValueError, match="family 'flux' is already registered"):
        registry.register_family(replace(TOY, name="flux", models=()))
    clash = replace(TOY, models=(replace(TOY.models[0], name="tiny-flux"),))
    with pytest.raises(ValueError, match="tiny-flux already registered"):
        registry.register_family(clash)
    assert "toy" not in registry.FAMILIES  # a refused record leaves nothing behind


def test_every_place_reads_the_built_in_records() -> None:
    """The built-in families' code references resolve, and each checkpoint's family knows it."""
    from pipelines.family import load
    from pipelines.registry import FAMILIES, MODELS, family_of

    for family in FAMILIES.values():
        for reference in (family.transformer, family.pipeline, family.parallelize, family.tensor_parallel,
                          family.limits, family.bench.inputs):
            assert callable(load(reference)), reference
        for reference in (family.transformer_setup, family.bench.tiny_checkpoint):  # optional functions
            assert not reference or callable(load(reference)), reference
        assert not family.bench.tiny_config or isinstance(load(family.bench.tiny_config), dict)
    for spec in MODELS.values():
        assert spec in family_of(spec).models

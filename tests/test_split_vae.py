"""The split VAE decode and encode (pipelines/split_vae.py) equal the whole ones.

Through the pipelines at 2, 3 and 4 gloo ranks: tiny-flux images and tiny-cosmos 17- and 33-frame videos
whose latent rows do not divide by the rank count; the tolerance is one 8-bit level of the written
media and 1e-4 on the VAE's output in [-1, 1] (measured: 1 level where a difference of about 1e-6
flips a rounding; at most 4e-6 on the output). The split encode of tiny-cosmos' input (an image, and a
video of more frames than the request's) gives the one-rank latents within 1e-4 on every rank. In one
process, parts one after another, the VAEs of the newer families too (FLUX.2's, Cosmos 3's Wan 2.2).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.split_vae import Parts, encode_splits, halos, split_decode, split_rows, splits
from tests.helpers import join_ranks, spawn_ranks

LEVELS = 1
"""Largest difference allowed between split and whole decodes, in 8-bit levels of the media."""
RAW = 1e-4
"""Largest difference allowed between the VAE outputs (in [-1, 1])."""

CASES = {
    # name: (model, request fields); latent rows 26 (flux: 208 / 8) and 14 (cosmos: 112 / 8)
    "flux-image": ("tiny-flux", dict(prompt="x", height=208, width=48, steps=1)),
    "cosmos-17": ("tiny-cosmos", dict(prompt="x", height=112, width=48, frames=17, steps=1)),
    "cosmos-33": ("tiny-cosmos", dict(prompt="x", height=112, width=32, frames=33, steps=1)),
}


def _latents(pipeline, request) -> torch.Tensor:
    """Random latents of the request's shape, as the denoising loop returns them (the same on every rank)."""
    generator = torch.Generator().manual_seed(3)
    factor = pipeline.vae_spatial_factor
    rows, cols = request.height // factor, request.width // factor
    if pipeline.spec.family == "flux":
        channels = pipeline.transformer_config.in_channels
        return torch.randn(1, rows // 2 * cols // 2, channels, generator=generator)
    frames = (request.frames - 1) // pipeline.temporal_factor + 1
    return torch.randn(1, pipeline.vae_config["z_dim"], frames, rows, cols, generator=generator)


def _inputs(folder: Path) -> dict[str, str]:
    """An input image and an input video (21 frames, more than the requests' 17) for tiny-cosmos."""
    from PIL import Image

    from pipelines.media import save_mp4

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (21, 224, 32, 3), dtype=np.uint8)
    Image.fromarray(frames[0]).save(folder / "start.png")
    save_mp4(frames, folder / "start.mp4", fps=8)
    return {"image-input": str(folder / "start.png"), "video-input": str(folder / "start.mp4")}


def _encode_cases(ctx, inputs: dict[str, str]) -> dict[str, dict]:
    """Rank 0 encodes (leaving the input's VAE encode to every rank), every rank prepares; rank 0 compares the
    conditioning latents with its own one-rank encoding."""
    import torch.distributed as dist

    from pipelines.factory import load_pipeline
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    spec, folder = resolve_model("tiny-cosmos", None)
    pipeline = load_pipeline(spec, folder, with_encoders=ctx.is_main, with_vae=True)
    report = {}
    for case, path in inputs.items():
        # 224 rows: the encoder's 45-row halos leave each band at most 3/4 of them (MAX_BAND_SHARE)
        request = make_request(spec, read_limits(spec, folder), prompt="x", condition=path, frames=17, height=224,
                               width=32, steps=1)
        pipeline.use_split_vae(ctx.group)
        encoded = [pipeline.encode(request) if ctx.is_main else None]
        dist.broadcast_object_list(encoded, src=0, group=ctx.control_group)
        if encoded[0].condition_frames is None:
            raise RuntimeError(f"{case}: expected the input's encode to be split")
        cond = pipeline.prepare(request, encoded[0])
        sums: list = [None] * ctx.world_size
        dist.all_gather_object(sums, float(cond.conditioning_latents.double().sum()), group=ctx.control_group)
        if ctx.is_main:
            pipeline.use_split_vae(None)
            whole = pipeline.encode(request)
            report[case] = dict(
                difference=float((cond.conditioning_latents - whole.conditioning_latents).abs().max()),
                same_on_every_rank=len(set(sums)) == 1,
                frames=cond.num_cond_latent_frames == whole.num_cond_latent_frames)
    return report


def _rank(rank: int, world_size: int, port: int, out: str, inputs: dict[str, str]) -> None:
    join_ranks(rank, world_size, port)
    import torch.distributed as dist

    from engines.parallel.distributed import init_parallel, shutdown
    from pipelines.factory import load_pipeline
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    ctx = init_parallel("cpu")
    report = {}
    with torch.no_grad():
        for case, (model, fields) in CASES.items():
            spec, folder = resolve_model(model, None)
            request = make_request(spec, read_limits(spec, folder), **fields)
            pipeline = load_pipeline(spec, folder, with_encoders=False, with_vae=True)
            latents = _latents(pipeline, request)
            pipeline.use_split_vae(ctx.group)
            if not pipeline.decode_is_split(request):
                raise RuntimeError(f"{case}: expected a split decode at {world_size} ranks")
            split = pipeline.decode(request, latents)
            if ctx.is_main:
                pipeline.use_split_vae(None)
                whole = pipeline.decode(request, latents)
                difference = np.asarray(split).astype(np.int16) - np.asarray(whole).astype(np.int16)
                report[case] = int(np.abs(difference).max())
            elif split is not None:
                raise RuntimeError(f"rank {rank} got the decoded media; only rank 0 should")
    encoding = _encode_cases(ctx, inputs)
    dist.barrier()
    if ctx.is_main:
        Path(out).write_text(json.dumps(dict(levels=report, encode=encoding)))
    shutdown(ctx)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_split_decode_at_n_ranks_equals_the_whole_decode(ranks: int, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    spawn_ranks(_rank, ranks, str(out), _inputs(tmp_path))
    report = json.loads(out.read_text())
    levels, encoding = report["levels"], report["encode"]
    assert set(levels) == set(CASES)
    assert max(levels.values()) <= LEVELS, levels
    assert set(encoding) == {"image-input", "video-input"}
    for case in encoding.values():
        assert case["same_on_every_rank"] and case["frames"] and case["difference"] <= RAW, encoding


def _random(vae: torch.nn.Module) -> torch.nn.Module:
    """Random weights everywhere (the default initialisation leaves some layers at zero or one)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 0.2)
    return vae.eval()


def _tiny_vaes() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLWan

    from pipelines.registry import ASSETS_DIR

    generator = torch.Generator().manual_seed(1)
    flux2 = AutoencoderKLFlux2(block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                               up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=4, latent_channels=8)
    wan22 = AutoencoderKLWan(base_dim=8, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                             temperal_downsample=[False, True, True], in_channels=12, out_channels=12, patch_size=2,
                             is_residual=True, scale_factor_spatial=16, scale_factor_temporal=4,
                             latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return {
        "tiny-flux": (AutoencoderKL.from_pretrained(ASSETS_DIR / "tiny-flux" / "vae").eval(),
                      torch.randn(1, 4, 13, 11, generator=generator)),
        "tiny-cosmos": (cosmos := AutoencoderKLWan.from_pretrained(ASSETS_DIR / "tiny-cosmos" / "vae").eval(),
                        torch.randn(1, cosmos.config.z_dim, 3, 11, 7, generator=generator)),
        "flux2": (_random(flux2), torch.randn(1, 8, 9, 7, generator=generator)),
        "cosmos3-wan2.2": (_random(wan22), torch.randn(1, 8, 3, 9, 6, generator=generator)),
    }


def test_parts_one_after_another_equal_the_whole_decode_for_every_served_vae() -> None:
    from diffusers import AutoencoderKLWan

    from pipelines.registry import ASSETS_DIR
    from pipelines.split_vae import encode_wan

    with torch.no_grad():
        wan = AutoencoderKLWan.from_pretrained(ASSETS_DIR / "tiny-cosmos" / "vae").eval()
        video = torch.rand(1, 3, 9, 104, 40, generator=torch.Generator().manual_seed(2)) * 2 - 1
        posterior = wan.encode(video).latent_dist
        for count in (2, 3, 4):  # 13 latent rows: uneven bands
            moments = encode_wan(wan, video, Parts.local(count))
            assert (moments - torch.cat([posterior.mean, posterior.logvar], dim=1)).abs().max() <= RAW
        for name, (vae, z) in _tiny_vaes().items():
            whole = vae.decode(z).sample
            for count in (2, 3, 4):
                parts = Parts.local(count, device=torch.device("cpu"))
                split = split_decode(vae, z, parts)
                assert split.shape == whole.shape, name
                assert (split - whole).abs().max().item() <= RAW, (name, count, (split - whole).abs().max().item())
                assert sorted(parts.seconds) == list(range(count)) and min(parts.seconds.values()) > 0


def test_rows_halos_and_when_a_decode_or_an_encode_splits() -> None:
    from diffusers import AutoencoderKL, AutoencoderKLWan

    from pipelines.registry import ASSETS_DIR

    assert split_rows(14, 4) == [(0, 4), (4, 8), (8, 11), (11, 14)]
    with pytest.raises(ValueError, match="cannot split 3 rows into 4"):
        split_rows(3, 4)
    assert splits(8, 4) and not splits(7, 4) and not splits(100, 1)
    decoder = AutoencoderKL.from_pretrained(ASSETS_DIR / "tiny-flux" / "vae").decoder
    # tiny-flux: 2 convs per resnet x 2 resnets a block, an upsampler conv after the first three of the four
    # blocks, and conv_out (1): from the head back, 1 -> 1 + 4 = 5 -> ceil((5 + 1) / 2) + 4 = 7 -> 8 -> 9
    assert halos(list(decoder.up_blocks), [decoder.conv_out]) == [9, 8, 7, 5, 1]
    # tiny-cosmos' encoder reaches 45 input rows: at 128 rows a band would be most of the input, at 224 not
    wan = AutoencoderKLWan.from_pretrained(ASSETS_DIR / "tiny-cosmos" / "vae")
    assert not encode_splits(wan, 128, 2) and encode_splits(wan, 224, 2) and encode_splits(wan, 224, 4)
    assert not encode_splits(wan, 224, 1)

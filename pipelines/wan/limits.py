"""What a Wan request may ask for (both Wan records' limits)."""

from __future__ import annotations

from pathlib import Path

from pipelines.family import ModelSpec
from pipelines.registry import read_component_config
from pipelines.requests import MediaLimits


def wan_limits(spec: ModelSpec, folder: Path) -> MediaLimits:
    """Wan: sizes a multiple of the VAE's spatial factor x the transformer's patch (16; Wan 2.2's VAE: 32), up to
    the long side of the checkpoint's published resolution in either orientation (its default size: 832 for 480p,
    1280 for 720p) and within its rotary table (rope_max_seq_len patches a side); frames 1 + k x the VAE's
    temporal factor (4), up to the checkpoint's published length (its default: 81, TI2V's 121). The input is
    one image, the first frame: required by an image-to-video transformer (its input channels add the image's),
    optional for Wan 2.2 TI2V (expand_timesteps in model_index.json), refused by text-to-video."""
    from pipelines.registry import read_model_index

    vae = read_component_config(folder, "vae")
    transformer = read_component_config(folder, "transformer")
    spatial = int(vae.get("scale_factor_spatial", 2 ** len(vae["temperal_downsample"])))
    temporal = int(vae.get("scale_factor_temporal", 2 ** sum(vae["temperal_downsample"])))
    patch_t, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    table = int(transformer.get("rope_max_seq_len", 1024))
    side = max(spec.height, spec.width)
    image_to_video = transformer.get("in_channels", 16) != transformer.get("out_channels", 16)  # + image channels
    return MediaLimits(
        size_multiple=spatial * max(patch_h, patch_w),
        max_height=min(side, table * patch_h * spatial),
        max_width=min(side, table * patch_w * spatial),
        frame_multiple=temporal,
        max_frames=min(spec.frames, (table * patch_t - 1) * temporal + 1),
        video_input=image_to_video or bool(read_model_index(folder).get("expand_timesteps")),
        first_frame_input=True,
        input_required=image_to_video,
    )

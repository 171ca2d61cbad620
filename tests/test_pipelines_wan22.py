"""Wan 2.2 TI2V through our pipeline, beyond its equality with diffusers (tests/test_conformance.py): the
checkpoint's limits read from its configs (16x space: a 2x2 patchify then 8x), and bad requests refused.

The checkpoint is pipelines.wan.tiny' tiny TI2V folder: a UMT5 encoder, a Wan 2.2-style VAE (2x2 patchify then
8x: 16x space, 4x time) with per-channel latent statistics, a 12-head transformer, UniPC with flow sigmas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.wan.tiny import save_wan, wan_components

    path = tmp_path_factory.mktemp("wan22") / "Wan2.2-TI2V-5B-Diffusers"
    save_wan(path, wan_components(seed=1, kind="ti2v"), expand_timesteps=True)
    return path


def test_limits_from_the_configs_and_bad_requests_refused(folder: Path, tmp_path: Path) -> None:
    spec, path = resolve_model("wan2.2-ti2v-5b", folder)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.frame_multiple, limits.max_frames) == (32, 4, 121)  # 16x VAE x 2x2 patch
    assert (limits.max_height, limits.max_width) == (1280, 1280)  # 720p, either orientation
    assert limits.video_input and limits.first_frame_input and not limits.input_required
    assert make_request(spec, limits, prompt="a circle").height == 704  # the published default
    with pytest.raises(RequestError, match="width 80 is not a multiple of 32"):
        make_request(spec, limits, prompt="a circle", width=80)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    with pytest.raises(RequestError, match="is a video; this model starts a video from an image"):
        make_request(spec, limits, prompt="a circle", condition=str(clip))

"""Pipelines on the embedded tiny models: equality with diffusers, determinism, stage boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import resolve_model
from pipelines.requests import make_request, read_limits
from tests.helpers import tiny_cosmos_frames_problem


def tiny(name: str, **fields):
    spec, folder = resolve_model(name, None)
    return spec, folder, make_request(spec, read_limits(spec, folder), **fields)


@pytest.fixture(scope="module")
def flux():
    spec, folder, _ = tiny("tiny-flux", prompt="x")
    return load_pipeline(spec, folder)


@pytest.fixture(scope="module")
def cosmos():
    spec, folder, _ = tiny("tiny-cosmos", prompt="x")
    return load_pipeline(spec, folder)


def test_flux_is_deterministic_and_seed_dependent(flux):
    _, _, request = tiny("tiny-flux", prompt="a green square", seed=3, steps=2, height=64, width=64)
    first = np.asarray(flux.generate(request))
    again = np.asarray(flux.generate(request))
    other = np.asarray(flux.generate(request.with_seed(4)))
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_flux_stages_compose_like_generate(flux):
    _, _, request = tiny("tiny-flux", prompt="a blue star", seed=5, steps=2, height=64, width=64)
    text = flux.encode(request)
    steps_seen = []
    latents = flux.denoise(request, text, on_step=lambda done, total: steps_seen.append((done, total)))
    assert steps_seen == [(1, 2), (2, 2)]
    assert latents.shape == (1, (64 // 16) ** 2, 16)
    assert np.array_equal(np.asarray(flux.decode(request, latents)), np.asarray(flux.generate(request)))


def test_cosmos_text_to_video_shape_and_determinism(cosmos):
    _, _, request = tiny("tiny-cosmos", prompt="a red circle moving left", seed=1, steps=3, frames=9,
                         height=64, width=96)
    frames = cosmos.generate(request)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8
    assert np.array_equal(frames, cosmos.generate(request))


def test_cosmos_batched_guidance_equals_two_separate_calls(cosmos):
    """The cond/uncond batch of two gives what diffusers' two transformer calls give."""
    _, _, request = tiny("tiny-cosmos", prompt="a yellow square", seed=2, steps=2, frames=5,
                         height=64, width=64, guidance=4.0)
    cond = cosmos.encode(request)
    batched = cosmos.denoise(request, cond)

    transformer = cosmos.transformer

    def one_branch_at_a_time(**kwargs):
        outputs = []
        for b in range(kwargs["hidden_states"].shape[0]):
            single = {k: (v[b : b + 1] if isinstance(v, torch.Tensor) and k != "padding_mask" else v)
                      for k, v in kwargs.items()}
            outputs.append(transformer(**single)[0])
        return (torch.cat(outputs),)

    cosmos.use_transformer(one_branch_at_a_time)
    try:
        separate = cosmos.denoise(request, cond)
    finally:
        cosmos.use_transformer(transformer)
    # Batched matmuls round differently in float32; guidance 4 amplifies that to ~3e-5.
    torch.testing.assert_close(batched, separate, rtol=1e-4, atol=1e-4)


def test_cosmos_video_to_world_keeps_the_given_frame(cosmos, tmp_path):
    from PIL import Image

    image_path = tmp_path / "start.png"
    pattern = np.zeros((64, 64, 3), dtype=np.uint8)
    pattern[:, :32] = (255, 0, 0)
    Image.fromarray(pattern).save(image_path)
    _, _, request = tiny("tiny-cosmos", prompt="a red shape", seed=1, steps=2, frames=9, height=64, width=64,
                         condition=str(image_path))
    cond = cosmos.encode(request)
    assert cond.num_cond_latent_frames == 1
    latents = cosmos.denoise(request, cond)
    # The given latent frame is pulled to the conditioning latents (up to the final sigma_min noise)...
    given = cond.conditioning_latents[:, :, :1]
    assert (latents[:, :, :1] - given).abs().max() < 0.05
    # ...which a text-only request of the same seed does not do.
    text_only_request = request.__class__(**{**request.to_dict(), "condition": None})
    text_only = cosmos.denoise(text_only_request, cosmos.encode(text_only_request))
    assert (text_only[:, :, :1] - given).abs().max() > 0.5


def test_a_request_with_several_bad_fields_is_one_error_naming_them_all():
    from pipelines.requests import RequestError

    with pytest.raises(RequestError) as error:
        tiny("tiny-cosmos", prompt=" ", width=100, steps=0, frames=6, fps=0)
    assert error.value.problems == [
        "prompt is empty: describe what to generate",
        "width 100 is not a multiple of 16, which this model needs; use 96 or 112 (multiples of 16 from 16 to 1024)",
        "steps must be between 1 and 500, got 0",
        tiny_cosmos_frames_problem(6),
        "fps must be between 1 and 240, got 0",
    ]
    assert str(error.value).startswith("5 problems with this request: (1) prompt is empty")
    with pytest.raises(RequestError) as error:
        tiny("tiny-flux", prompt="x", height=65)
    assert str(error.value) == ("height 65 is not a multiple of 16, which this model needs; use 64 or 80 "
                                "(multiples of 16 from 16 to 4096)")


@pytest.mark.parametrize(("model", "fields", "problem"), [
    # Out of range: the bound alone, no suggestion beyond it.
    ("tiny-cosmos", dict(frames=10000), "frames 10000 is too large: at most 63 (1 + a multiple of 2, from 1 to 63)"),
    ("tiny-cosmos", dict(frames=0), "frames 0 is too small: at least 1 (1 + a multiple of 2, from 1 to 63)"),
    ("tiny-flux", dict(width=99999), "width 99999 is too large: at most 4096 (multiples of 16 from 16 to 4096)"),
    ("tiny-flux", dict(height=-20), "height -20 is too small: at least 16 (multiples of 16 from 16 to 4096)"),
    # Off the grid inside the range: the valid values either side, only those inside it.
    ("tiny-flux", dict(width=4095), "width 4095 is not a multiple of 16, which this model needs; use 4080 or 4096 "
                                    "(multiples of 16 from 16 to 4096)"),
    ("tiny-flux", dict(width=5), "width 5 is too small: at least 16 (multiples of 16 from 16 to 4096)"),
    ("tiny-flux", dict(height=17), "height 17 is not a multiple of 16, which this model needs; use 16 or 32 "
                                   "(multiples of 16 from 16 to 4096)"),
    ("tiny-cosmos", dict(frames=62), "frames 62 is not 1 + a multiple of 2, which this model needs; use 61 or 63 "
                                     "(1 + a multiple of 2, from 1 to 63)"),
    # Not whole numbers, and not numbers at all (a form or API client's text): refused, never rounded.
    ("tiny-flux", dict(steps=2.5), "steps must be a whole number (1 to 500), got 2.5"),
    ("tiny-flux", dict(steps="abc"), "steps must be a whole number (1 to 500), got 'abc'"),
    ("tiny-flux", dict(seed=1.5), f"seed must be a whole number (0 to {2**63 - 1}), got 1.5"),
    ("tiny-flux", dict(width="12.5"), "width must be a whole number (multiples of 16 from 16 to 4096), got '12.5'"),
    ("tiny-cosmos", dict(frames=float("nan")),
     "frames must be a whole number (1 + a multiple of 2, from 1 to 63), got nan"),
    ("tiny-flux", dict(frames="x"), "frames must be a whole number (1 for an image model), got 'x'"),
    ("tiny-cosmos", dict(fps=True), "fps must be a whole number (1 to 240), got True"),
    ("tiny-flux", dict(guidance="abc"), "guidance must be a number (0 to 100), got 'abc'"),
])
def test_each_bad_field_is_named_with_its_range_and_only_valid_suggestions(model, fields, problem):
    from pipelines.requests import RequestError

    with pytest.raises(RequestError) as error:
        tiny(model, prompt="x", **fields)
    assert error.value.problems == [problem]


def test_whole_numbers_may_come_as_floats_or_text():
    _, _, request = tiny("tiny-cosmos", prompt="x", steps=2.0, seed=" 7 ", frames="9.0", width="64", height=80.0,
                         guidance="4.5")
    assert (request.steps, request.seed, request.frames, request.width, request.height, request.guidance) == \
        (2, 7, 9, 64, 80, 4.5)
    assert all(type(value) is int for value in (request.steps, request.seed, request.frames, request.width))
    # a seed as text keeps every digit (a float would not)
    assert tiny("tiny-flux", prompt="x", seed=str(2**63 - 1))[2].seed == 2**63 - 1


def test_an_input_path_the_file_system_refuses_is_refused_with_a_message(tmp_path):
    """A name longer than the file system allows (or a folder this process may not enter) makes the existence check
    itself fail: that is a RequestError naming the file, not an OSError out of make_request."""
    from pipelines.requests import RequestError

    with pytest.raises(RequestError, match=r"input file a+\.png cannot be read"):
        tiny("tiny-cosmos", prompt="x", condition=str(tmp_path / ("a" * 300 + ".png")))


def test_a_phone_photo_is_read_upright_by_its_exif_orientation(tmp_path):
    """A camera's JPEG stored sideways with EXIF orientation 6 (turn 90 degrees clockwise to view): every reader of
    an input image's pixels (a reference or first frame, a video-to-world frame) sees it upright, as diffusers'
    load_image does, not on its side."""
    from pathlib import Path

    from PIL import Image

    from pipelines.media import EXIF_ORIENTATION, open_image, read_frames

    stored = Image.new("RGB", (48, 32), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 24, 32))  # left half red: upright, the top half
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    path = tmp_path / "photo.jpg"
    stored.save(path, exif=exif, quality=95)
    for image in (open_image(path), read_frames(path, (32, 48))[0]):
        assert image.size == (32, 48)
        top, bottom = np.asarray(image)[4, 16], np.asarray(image)[44, 16]
        assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0], (top, bottom)
    pipelines = Path(__file__).resolve().parent.parent / "pipelines"
    assert not [path for path in pipelines.glob("*/pipeline.py") if "Image.open(" in path.read_text()]

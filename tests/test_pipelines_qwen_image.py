"""Qwen-Image through our pipeline, beyond its equality with diffusers (tests/test_conformance.py): the limits read
from its configs, and the work estimate of guidance's two calls.

The checkpoint is pipelines.qwen_image.tiny' Qwen-Image folder: a two-layer Qwen2.5-VL text encoder under a
word-level Qwen tokenizer, Qwen-Image's VAE shrunk, a 12-head transformer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a big red circle on the left"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from pipelines.qwen_image.tiny import qwen_image_components, save_qwen_image

    path = tmp_path_factory.mktemp("qwen-image") / "Qwen-Image"
    save_qwen_image(path, qwen_image_components(seed=1))
    return path


def request(folder: Path, **fields):
    spec, path = resolve_model("qwen-image", folder)
    fields = {"prompt": PROMPT, "seed": 7, "steps": 2, "height": 64, "width": 48, **fields}
    return spec, path, make_request(spec, read_limits(spec, path), **fields)


def test_limits_from_the_configs(folder: Path) -> None:
    spec, path = resolve_model("qwen-image", folder)
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.max_height, limits.reference_image) == (16, 4096, False)
    assert read_limits(spec, path, cfg_parallel=True).guidance_split  # its two calls, one per CFG group
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)


def test_a_guided_request_counts_both_guidance_calls(folder: Path) -> None:
    """Its two branches are two calls (guidance_calls): the time limit's work estimate counts both."""
    from pipelines.work import WorkCounter

    spec, path = resolve_model("qwen-image", folder)
    count = WorkCounter(spec, path, read_limits(spec, path))
    guided, plain = count(request(folder, guidance=4.0)[2]), count(request(folder, guidance=1.0)[2])
    assert guided.step_flops == pytest.approx(2 * plain.step_flops, rel=1e-6)
    assert guided.decode_flops == plain.decode_flops

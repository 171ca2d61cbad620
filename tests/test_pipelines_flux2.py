"""FLUX.2 through our pipeline, beyond its equality with diffusers and its ranks' with one process
(tests/test_conformance.py): bad requests refused by the checks.

The checkpoints are pipelines.flux2.tiny' FLUX.2 folders: Mistral 3 (dev) or Qwen3 (Klein) text encoders with
as many layers as the pipelines read, FLUX.2's VAE with batch-norm statistics, a 6-head transformer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from pipelines.registry import resolve_model
from pipelines.requests import RequestError, make_request, read_limits

PROMPT = "a red circle on the left"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from pipelines.flux2.tiny import flux2_components, save_flux2

    root = tmp_path_factory.mktemp("flux2")
    paths = {"klein": root / "tiny-flux2-klein"}
    save_flux2(paths["klein"], flux2_components(seed=1, variant="klein"))
    image = np.zeros((80, 112, 3), np.uint8)
    image[16:48, 20:70] = (200, 30, 30)
    PIL.Image.fromarray(image).save(root / "reference.png")
    PIL.Image.fromarray(image[:40, :56]).save(root / "small.png")
    PIL.Image.fromarray(np.zeros((64, 600, 3), np.uint8)).save(root / "wide.png")
    return paths


def test_bad_requests_refused_by_the_checks(folders: dict[str, Path]) -> None:
    spec, path = resolve_model("flux2-klein-4b", folders["klein"])
    limits = read_limits(spec, path)
    assert (limits.size_multiple, limits.reference_image) == (16, True)
    root = path.parent
    with pytest.raises(RequestError, match="width 40 is not a multiple of 16"):
        make_request(spec, limits, prompt=PROMPT, width=40)
    with pytest.raises(RequestError, match="reference image small.png is 56x40; both sides must be at least 64"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "small.png"))
    with pytest.raises(RequestError, match="wide.png is 600x64; its long side may be at most 8 times"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "wide.png"))
    with pytest.raises(RequestError, match="clip.mp4 is a video; this model takes a reference image"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "clip.mp4"))
    with pytest.raises(RequestError, match="input file missing.png does not exist"):
        make_request(spec, limits, prompt=PROMPT, condition=str(root / "missing.png"))
    flux1, flux1_path = resolve_model("tiny-flux", None)
    with pytest.raises(RequestError, match="takes no input image"):
        make_request(flux1, read_limits(flux1, flux1_path), prompt=PROMPT, condition=str(root / "reference.png"))
    base, _ = resolve_model("flux2-klein-base-4b", folders["klein"])
    with pytest.raises(RequestError, match="guidance must be above 1 here"):
        make_request(base, read_limits(base, path, cfg_parallel=True), prompt=PROMPT, guidance=1.0)


# --- several ranks through the app's runtime ----------------------------------------------------




def test_the_work_estimate_counts_a_reference_at_the_most_the_pipeline_keeps(folders: dict[str, Path]) -> None:
    """The time limit's work estimate (pipelines.work) counts a reference image's tokens after the image's, as the
    transformer takes them: at 1024², the most FLUX.2 keeps (4096 tokens), so a 64x64 image (16 tokens) with a
    reference costs what a 4112-token image costs."""
    from pipelines.flux2.limits import REFERENCE_MAX_AREA
    from pipelines.work import WorkCounter

    spec, path = resolve_model("flux2-klein-4b", folders["klein"])
    limits = read_limits(spec, path)
    assert limits.reference_area == REFERENCE_MAX_AREA == 1024 * 1024
    count = WorkCounter(spec, path, limits)
    reference = str(path.parent / "reference.png")
    edit = count(make_request(spec, limits, prompt=PROMPT, height=64, width=64, condition=reference))
    alone = count(make_request(spec, limits, prompt=PROMPT, height=64, width=64))
    one_grid = count._count(16 * 16, 257 * 16, 1, 1, None)  # 16 x 257 = 4112 tokens
    assert edit.step_flops == pytest.approx(one_grid.step_flops, rel=1e-9)
    assert edit.step_flops > 10 * alone.step_flops and edit.decode_flops == alone.decode_flops

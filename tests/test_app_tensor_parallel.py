"""`generate --tp 2` on two gloo ranks: the embedded tiny-flux loaded split from its safetensors file by each
rank (pipelines.loading's TransformerShare) draws the image of one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers import join_ranks, spawn_ranks


def _generate(rank: int, world_size: int, port: int, tp: int, out: str) -> None:
    join_ranks(rank, world_size, port)
    from app.commands.cli import main

    status = main(["generate", "--model", "tiny-flux", "--prompt", "a red circle", "--size", "64x64", "--steps", "3",
                   "--seed", "5", "--tp", str(tp), "--quiet", "--out", out])
    if status != 0:
        raise SystemExit(f"generate exited with status {status}")


def test_generate_with_tp_2_draws_the_single_process_image(tmp_path: Path) -> None:
    images = {}
    for ranks, tp in ((1, 1), (2, 2)):
        out = tmp_path / f"{ranks}-tp{tp}.png"
        spawn_ranks(_generate, ranks, tp, str(out))
        images[tp] = np.asarray(Image.open(out)).astype(np.int16)
    assert images[1].std() > 1
    assert np.abs(images[2] - images[1]).max() <= 1

"""The README's generate examples run as written, in order, in an empty folder, and make what they say."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import numpy as np
from PIL import Image

from pipelines.media import read_video
from tests.helpers import REPO
from training import judge, shapes
from training.evaluate import judge_videos


def readme_generate_commands() -> list[list[str]]:
    """Every `ulysses-studio generate` line of the README's bash blocks, split as a shell splits it."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    lines = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    return [argv for argv in lines if argv[:2] == ["ulysses-studio", "generate"]]


def _asked(prompt: str) -> tuple[str, str, str | None]:
    """The colour, shape and motion (None for images) a caption in the tiny models' wording names."""
    words = prompt.split()
    colour = next(word for word in words if word in shapes.COLOURS)
    shape = next(word for word in words if word in shapes.SHAPES)
    motion = next((m for m, phrase in shapes.MOTION_PHRASES.items() if phrase in prompt), None)
    return colour, shape, motion


def test_readme_generate_examples_run_as_written(tmp_path):
    commands = readme_generate_commands()
    models = [argv[argv.index("--model") + 1] for argv in commands]
    assert {"tiny-flux", "tiny-cosmos"} <= set(models), commands
    for argv in commands:  # in order: a line may read what a line above it wrote (--input)
        run = subprocess.run([sys.executable, "-m", "app", *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"{shlex.join(argv)}\n{run.stderr[-2000:]}"
        out = tmp_path / argv[argv.index("--out") + 1]
        colour, shape, motion = _asked(argv[argv.index("--prompt") + 1])
        if motion is None:
            with Image.open(out) as image:
                verdict = judge.judge_image(np.asarray(image.convert("RGB")))
            assert (verdict.colour, verdict.shape) == (colour, shape), shlex.join(argv)
        else:
            frames, _ = read_video(out)
            scores = judge_videos([np.stack(frames)], [("", colour, shape, motion)])
            assert (scores.colour, scores.shape, scores.motion) == (1, 1, 1), f"{shlex.join(argv)}: {scores.seen}"

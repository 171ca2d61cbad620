"""Procedural scenes with captions: one coloured shape on a plain background, still or moving.

Everything is drawn from a seed with torch on the training device (no files, no downloads), so a
batch costs microseconds and the data set is endless. A scene is a handful of numbers (shape,
colour, centre, half-size, background); `render` turns scenes into antialiased RGB in [-1, 1].

Captions use only words that the tiny models' T5 tokenizer keeps whole (training/tiny_models.py
CAPTION_WORDS), e.g. "a big red circle at the top left on a white background" or
"a blue square moving right on a black background". A fixed set of (colour, shape, background)
and (colour, shape, motion) combinations is never drawn in training: the quality tests prompt for
those, so they measure composition, not recall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle", "diamond", "star")
COLOURS = {
    "red": (220, 30, 30),
    "orange": (245, 135, 20),
    "yellow": (245, 220, 30),
    "green": (30, 165, 50),
    "blue": (30, 70, 225),
    "purple": (135, 45, 190),
}
"""Shape colours, also allowed as backgrounds (never the shape's own colour)."""
NEUTRALS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
BACKGROUNDS = {**NEUTRALS, **COLOURS}
SIZES = {"small": (0.10, 0.14), "big": (0.20, 0.26)}
"""Half-size of a shape as a fraction of the image width."""
POSITIONS = {
    "at the top left": (0.25, 0.25), "at the top": (0.5, 0.25), "at the top right": (0.75, 0.25),
    "at the left": (0.25, 0.5), "in the center": (0.5, 0.5), "at the right": (0.75, 0.5),
    "at the bottom left": (0.25, 0.75), "at the bottom": (0.5, 0.75), "at the bottom right": (0.75, 0.75),
}
"""Centre (x, y) of a position phrase, as fractions of width and height (y down)."""
MOVING_HALF = (0.18, 0.24)
"""Half-size range of a moving video shape, as a fraction of the frame width: 46-61 px across at 128x128,
3-4 of tiny-cosmos' 16-px tokens. At 0.10-0.16 (2-2.6 tokens) its 4-block transformer drew every shape
round, on training prompts too, and its VAE alone kept the shape of 71% of held-out clips (92% at this size)."""
GROWTH = ((0.09, 0.12), (0.26, 0.30))
"""Half-size ranges of a growing (or shrinking) video shape at its smallest and at its biggest."""
MOTIONS = ("left", "right", "up", "down", "growing", "shrinking")
MOTION_PHRASES = {"left": "moving left", "right": "moving right", "up": "moving up", "down": "moving down",
                  "growing": "growing", "shrinking": "shrinking"}
NEGATIVE_CAPTIONS = ("", "blurry, static")
"""What caption dropout substitutes: the empty prompt and tiny-cosmos' default negative prompt."""


def _held_out(seed: int, n: int, third: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    rng = np.random.default_rng(seed)
    combos = [(c, s, t) for c in COLOURS for s in SHAPES for t in third if t != c]
    picks = rng.choice(len(combos), size=n, replace=False)
    return tuple(combos[i] for i in sorted(picks))


HELD_OUT_IMAGES = _held_out(2026, 24, tuple(BACKGROUNDS))
"""(colour, shape, background) never drawn for training images."""
HELD_OUT_VIDEOS = _held_out(2027, 24, MOTIONS)
"""(colour, shape, motion) never drawn for training videos."""


@dataclass(kw_only=True)
class Scenes:
    """A batch of B scenes over T frames (T = 1 for images); tensors are [B, T] unless noted."""

    shape: torch.Tensor
    """Index into SHAPES, [B]."""
    colour: torch.Tensor
    """RGB in 0..255, [B, 3]."""
    background: torch.Tensor
    """RGB in 0..255, [B, 3]."""
    cx: torch.Tensor
    cy: torch.Tensor
    """Centre as fractions of width / height (y down)."""
    half: torch.Tensor
    """Half-size as a fraction of the width."""
    captions: list[str]


def _shape_distance(kind: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Signed distance (in half-sizes, <0 inside) of points (x, y up) to each scene's unit shape."""
    rho = torch.sqrt(x * x + y * y)
    theta = torch.atan2(y, x)

    def polygon(n: int, normal_angle: float, apothem: float) -> torch.Tensor:
        # Regular n-gon: fold the angle into one edge's sector and measure along that edge's normal.
        sector = 2 * math.pi / n
        folded = torch.remainder(theta - normal_angle + sector / 2, sector) - sector / 2
        return rho * torch.cos(folded) - apothem

    circle = rho - 1.0
    square = polygon(4, 0.0, 0.82)
    triangle = polygon(3, -math.pi / 2, 0.5)  # pointing up, circumradius 1
    diamond = polygon(4, math.pi / 4, 1.0 / math.sqrt(2.0))
    # Five-pointed star pointing up: fold into half a point's sector, distance to the outer edge line.
    sector = 2 * math.pi / 5
    folded = torch.abs(torch.remainder(theta - math.pi / 2 + sector / 2, sector) - sector / 2)
    px, py = rho * torch.cos(folded), rho * torch.sin(folded)
    inner = 0.45
    ax, ay = 1.0, 0.0
    bx, by = inner * math.cos(sector / 2), inner * math.sin(sector / 2)
    nx, ny = by - ay, ax - bx  # outward normal of edge A->B
    norm = math.hypot(nx, ny)
    star = ((px - ax) * nx + (py - ay) * ny) / norm
    table = torch.stack([circle, square, triangle, diamond, star])  # [S, ...]
    return torch.gather(table, 0, kind.expand_as(circle).unsqueeze(0)).squeeze(0)


def render(scenes: Scenes, height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Scenes -> RGB frames in [-1, 1], [B, 3, T, H, W] (float32)."""
    batch = scenes.cx.shape[0]
    shape = coverage(scenes, height, width, device).unsqueeze(1)  # [B, 1, T, H, W]
    colour = scenes.colour.to(device).float().view(batch, 3, 1, 1, 1) / 127.5 - 1
    background = scenes.background.to(device).float().view(batch, 3, 1, 1, 1) / 127.5 - 1
    return background + shape * (colour - background)


def coverage(scenes: Scenes, height: int, width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """How much of each pixel the scene's shape covers, 0..1 (one-pixel antialiasing), [B, T, H, W] (float32)."""
    batch, frames = scenes.cx.shape
    ys = (torch.arange(height, device=device, dtype=torch.float32) + 0.5) / width
    xs = (torch.arange(width, device=device, dtype=torch.float32) + 0.5) / width
    cx = scenes.cx.to(device).view(batch, frames, 1, 1)
    cy = (scenes.cy.to(device) * height / width).view(batch, frames, 1, 1)
    half = scenes.half.to(device).view(batch, frames, 1, 1)
    x = (xs.view(1, 1, 1, width) - cx) / half
    y = -(ys.view(1, 1, height, 1) - cy) / half
    kind = scenes.shape.to(device).view(batch, 1, 1, 1)
    distance = _shape_distance(kind, x, y) * half * width  # in pixels
    return (0.5 - distance).clamp(0.0, 1.0)


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3]."""
    return ((frames.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()


def _combos(third: tuple[str, ...], held_out: tuple[tuple[str, str, str], ...], want_held_out: bool) -> torch.Tensor:
    """[N, 3] index table of the (colour, shape, third) combinations one split may draw."""
    rows = [(ci, si, ti) for ci, c in enumerate(COLOURS) for si, s in enumerate(SHAPES) for ti, t in enumerate(third)
            if t != c and ((c, s, t) in held_out) == want_held_out]
    return torch.tensor(rows)


_IMAGE_COMBOS = {split: _combos(tuple(BACKGROUNDS), HELD_OUT_IMAGES, split) for split in (False, True)}
_VIDEO_COMBOS = {split: _combos(MOTIONS, HELD_OUT_VIDEOS, split) for split in (False, True)}


def _uniform(generator: torch.Generator, shape: tuple[int, ...], low, high) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=generator)


def image_scenes(batch: int, generator: torch.Generator, *, held_out: bool = False) -> Scenes:
    """Random still scenes with captions; held_out=True draws only from HELD_OUT_IMAGES."""
    table = _IMAGE_COMBOS[held_out]
    colour, shape, background = table[torch.randint(len(table), (batch,), generator=generator)].unbind(1)
    size = torch.randint(len(SIZES), (batch,), generator=generator)
    limits = torch.tensor(list(SIZES.values()))[size]
    half = _uniform(generator, (batch,), limits[:, 0], limits[:, 1])
    position = torch.randint(len(POSITIONS), (batch,), generator=generator)
    centre = torch.tensor(list(POSITIONS.values()))[position] + _uniform(generator, (batch, 2), -0.06, 0.06)
    margin = (half + 0.03).unsqueeze(1)
    centre = torch.minimum(torch.maximum(centre, margin), 1 - margin)
    # Captions leave out size, position or background now and then, so short prompts work too.
    keep = torch.rand((batch, 3), generator=generator) < torch.tensor([0.8, 0.7, 0.8])
    keep = (keep | held_out).tolist()
    colours, backgrounds, sizes, positions = list(COLOURS), list(BACKGROUNDS), list(SIZES), list(POSITIONS)
    captions = []
    for i, (c, s, b, z, p) in enumerate(zip(colour.tolist(), shape.tolist(), background.tolist(), size.tolist(),
                                            position.tolist())):
        words = [sizes[z]] if keep[i][0] else []
        words += [colours[c], SHAPES[s]]
        words.insert(0, _article(words[0]))
        if keep[i][1]:
            words.append(positions[p])
        if keep[i][2]:
            words.append(_on_background(backgrounds[b]))
        captions.append(" ".join(words))
    return Scenes(
        shape=shape, colour=_rgb(COLOURS, colour), background=_rgb(BACKGROUNDS, background),
        cx=centre[:, :1], cy=centre[:, 1:], half=half.unsqueeze(1), captions=captions,
    )


def video_scenes(batch: int, frames: int, generator: torch.Generator, *, held_out: bool = False,
                 word_dropout: float = 0.0, moving_half: tuple[float, float] = MOVING_HALF,
                 growth: tuple[tuple[float, float], tuple[float, float]] = GROWTH) -> Scenes:
    """Random moving scenes with captions; held_out=True draws only from HELD_OUT_VIDEOS.

    word_dropout: each caption leaves out its colour, its shape (saying "shape") and its motion, each with
    this probability, so that each word has to carry its meaning alone ("a triangle moving down", "a red
    shape moving down", "a red triangle on a black background"). At 0 nothing more is drawn from
    `generator`, so the scenes are those of earlier training runs.
    moving_half, growth: object sizes (MOVING_HALF, GROWTH).
    """
    table = _VIDEO_COMBOS[held_out]
    colour, shape, motion = table[torch.randint(len(table), (batch,), generator=generator)].unbind(1)
    # Any background but the shape's own colour (BACKGROUNDS lists the neutrals, then COLOURS in order).
    background = torch.randint(len(BACKGROUNDS) - 1, (batch,), generator=generator)
    background += (background >= len(NEUTRALS) + colour).long()
    t = torch.linspace(0, 1, frames).unsqueeze(0)

    # Growing / shrinking: still centre, half-size from small to big (or back).
    small, big = _uniform(generator, (batch, 1), *growth[0]), _uniform(generator, (batch, 1), *growth[1])
    grows = (motion == MOTIONS.index("growing")).unsqueeze(1)
    scaling = torch.where(grows, small + (big - small) * t, big + (small - big) * t)
    centre = _uniform(generator, (batch, 2), 0.4, 0.6)

    # Moving: fixed half-size, travel from one side to the other along one axis.
    half = _uniform(generator, (batch, 1), *moving_half)
    margin = half + 0.03
    start, end = _uniform(generator, (batch, 1), margin, 0.35), _uniform(generator, (batch, 1), 0.65, 1 - margin)
    backwards = ((motion == MOTIONS.index("left")) | (motion == MOTIONS.index("up"))).unsqueeze(1)
    start, end = torch.where(backwards, end, start), torch.where(backwards, start, end)
    across = start + (end - start) * t
    other = _uniform(generator, (batch, 1), margin, 1 - margin).expand(-1, frames)
    horizontal = ((motion == MOTIONS.index("left")) | (motion == MOTIONS.index("right"))).unsqueeze(1)
    moving = (motion < MOTIONS.index("growing")).unsqueeze(1)
    cx = torch.where(moving, torch.where(horizontal, across, other), centre[:, :1].expand(-1, frames))
    cy = torch.where(moving, torch.where(horizontal, other, across), centre[:, 1:].expand(-1, frames))
    half = torch.where(moving, half.expand(-1, frames), scaling)

    keep = ((torch.rand((batch,), generator=generator) < 0.8) | held_out).tolist()
    dropped = ((torch.rand((batch, 3), generator=generator) < word_dropout).tolist() if word_dropout
               else [[False] * 3] * batch)
    colours, backgrounds = list(COLOURS), list(BACKGROUNDS)
    captions = []
    for i, (c, s, m, b) in enumerate(zip(colour.tolist(), shape.tolist(), motion.tolist(), background.tolist())):
        no_colour, no_shape, no_motion = dropped[i]
        words = ([] if no_colour else [colours[c]]) + ["shape" if no_shape else SHAPES[s]]
        words = [_article(words[0]), *words] + ([] if no_motion else [MOTION_PHRASES[MOTIONS[m]]])
        if keep[i]:
            words.append(_on_background(backgrounds[b]))
        captions.append(" ".join(words))
    return Scenes(shape=shape, colour=_rgb(COLOURS, colour), background=_rgb(BACKGROUNDS, background),
                  cx=cx, cy=cy, half=half, captions=captions)


def _rgb(palette: dict[str, tuple[int, int, int]], index: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(palette.values()))[index]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _on_background(colour: str) -> str:
    return f"on {_article(colour)} {colour} background"


def held_out_image_prompts() -> list[tuple[str, str, str]]:
    """(prompt, colour, shape) for every held-out image combination: a big shape in the centre."""
    return [(f"a big {c} {s} in the center {_on_background(b)}", c, s) for c, s, b in HELD_OUT_IMAGES]


def held_out_video_prompts() -> list[tuple[str, str, str, str]]:
    """(prompt, colour, shape, motion) for every held-out video combination, on a black or white background."""
    prompts = []
    for i, (c, s, m) in enumerate(HELD_OUT_VIDEOS):
        background = "white" if i % 2 else "black"
        prompts.append((f"{_article(c)} {c} {s} {MOTION_PHRASES[m]} {_on_background(background)}", c, s, m))
    return prompts

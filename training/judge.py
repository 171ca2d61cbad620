"""Pixel judges for generated scenes: which colour, which shape, which way it moves.

No model is involved: the background is the median of the border pixels, the object is the largest
connected region that differs from it, its colour is the nearest named colour of its median pixel,
its shape is the template (drawn by training.shapes, stretched to the object's bounding box) with the
highest overlap, and its motion is the track of its centroid and area over the frames.
tests/test_training.py checks these judges on the generator's own ground truth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from training import shapes

MIN_CONTRAST = 60.0
"""RGB distance (0..255 scale) from the background above which a pixel belongs to the object."""
MIN_PIXELS = 12
"""Smaller objects count as no object."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """What one image shows, as the judges see it."""

    colour: str | None
    shape: str | None
    centroid: tuple[float, float] | None
    """(x, y) as fractions of width and height."""
    area: float
    """Object pixels as a fraction of the image."""


def background_colour(image: np.ndarray) -> np.ndarray:
    """Median RGB of the two-pixel border of an [H, W, 3] uint8 image."""
    border = np.concatenate([image[:2].reshape(-1, 3), image[-2:].reshape(-1, 3),
                             image[:, :2].reshape(-1, 3), image[:, -2:].reshape(-1, 3)])
    return np.median(border, axis=0)


def off_palette(image: np.ndarray, far: float = 60.0, off: float = 48.0) -> float:
    """Share of an [H, W, 3] uint8 image's pixels more than `off` levels away from the line between its
    background colour and its object's (pixels `far` from the background): specks and smears of colours the
    scene does not have. A clean drawing, anti-aliased edges included, has next to none."""
    pixels = image.reshape(-1, 3).astype(np.float32)
    background = background_colour(image).astype(np.float32)
    distant = pixels[np.linalg.norm(pixels - background, axis=1) > far]
    if len(distant) < 10:
        return 0.0
    direction = np.median(distant, axis=0) - background
    along = np.clip(((pixels - background) @ direction) / (direction @ direction), 0, 1)
    return float((np.linalg.norm(pixels - (background + along[:, None] * direction), axis=1) > off).mean())


def object_mask(image: np.ndarray) -> np.ndarray:
    """Boolean [H, W]: the largest 4-connected region that differs from the background."""
    distance = np.linalg.norm(image.astype(np.float32) - background_colour(image), axis=-1)
    return largest_component(distance > MIN_CONTRAST)


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean mask (breadth-first search; masks here are small)."""
    height, width = mask.shape
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, label = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        label += 1
        labels[y0, x0] = label
        queue, size = deque([(y0, x0)]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = label
                    queue.append((ny, nx))
        if size > best_size:
            best_label, best_size = label, size
    return labels == best_label if best_size else np.zeros_like(mask)


def colour_name(image: np.ndarray, mask: np.ndarray) -> str:
    """The named shape colour (shapes.COLOURS) nearest to the median colour of the masked pixels."""
    median = np.median(image[mask].astype(np.float32), axis=0)
    names = list(shapes.COLOURS)
    palette = np.array([shapes.COLOURS[n] for n in names], dtype=np.float32)
    return names[int(np.argmin(np.linalg.norm(palette - median, axis=1)))]


@lru_cache(maxsize=1)
def _templates() -> dict[str, np.ndarray]:
    """Each shape's mask cropped to its bounding box, drawn large by the data generator."""
    size = 128
    scenes = shapes.Scenes(
        shape=torch.arange(len(shapes.SHAPES)), colour=torch.full((len(shapes.SHAPES), 3), 255),
        background=torch.zeros(len(shapes.SHAPES), 3, dtype=torch.long),
        cx=torch.full((len(shapes.SHAPES), 1), 0.5), cy=torch.full((len(shapes.SHAPES), 1), 0.5),
        half=torch.full((len(shapes.SHAPES), 1), 0.45), captions=[""] * len(shapes.SHAPES),
    )
    masks = shapes.to_uint8(shapes.render(scenes, size, size))[:, 0, :, :, 0] > 127
    templates = {}
    for name, mask in zip(shapes.SHAPES, masks):
        ys, xs = np.nonzero(mask)
        templates[name] = mask[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    return templates


def shape_name(mask: np.ndarray) -> str:
    """The shape whose template, stretched to the mask's bounding box, overlaps the mask best (IoU)."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    height, width = box.shape
    best, best_iou = shapes.SHAPES[0], -1.0
    for name, template in _templates().items():
        rows = (np.arange(height) + 0.5) * template.shape[0] / height
        cols = (np.arange(width) + 0.5) * template.shape[1] / width
        stretched = template[rows.astype(int)][:, cols.astype(int)]
        iou = (stretched & box).sum() / max((stretched | box).sum(), 1)
        if iou > best_iou:
            best, best_iou = name, iou
    return best


def judge_image(image: np.ndarray) -> Verdict:
    """Colour, shape, centroid and area of the main object of an [H, W, 3] uint8 image."""
    mask = object_mask(image)
    if mask.sum() < MIN_PIXELS:
        return Verdict(colour=None, shape=None, centroid=None, area=0.0)
    ys, xs = np.nonzero(mask)
    height, width = mask.shape
    return Verdict(
        colour=colour_name(image, mask), shape=shape_name(mask),
        centroid=((xs.mean() + 0.5) / width, (ys.mean() + 0.5) / height), area=float(mask.mean()),
    )


GRAY_TOLERANCE = 24.0
"""RGB distance (0..255 scale) from shapes.NEUTRALS['gray'] within which a background counts as gray."""


def judge_gray_background(image: np.ndarray) -> bool:
    """Whether an [H, W, 3] uint8 image's background (median of its border) is plain gray: what
    assets/tiny-flux-lora-gray teaches (training/lora.py), whatever background the prompt asks."""
    gray = np.array(shapes.NEUTRALS["gray"], dtype=np.float32)
    return bool(np.linalg.norm(background_colour(image).astype(np.float32) - gray) <= GRAY_TOLERANCE)


def judge_motion(frames: np.ndarray, min_travel: float = 0.12, min_growth: float = 1.6) -> str:
    """'left', 'right', 'up', 'down', 'growing', 'shrinking' or 'still' for uint8 frames [T, H, W, 3].

    Compares the mean centroid and area of the first and last quarter of the frames in which an object
    is seen: travel of at least `min_travel` of the frame picks a direction, otherwise an area ratio
    of at least `min_growth` picks growing or shrinking.
    """
    seen = [v for v in (judge_image(frame) for frame in frames) if v.centroid is not None]
    if len(seen) < 2:
        return "still"
    quarter = max(1, len(seen) // 4)
    first, last = seen[:quarter], seen[-quarter:]
    x0, y0 = np.mean([v.centroid for v in first], axis=0)
    x1, y1 = np.mean([v.centroid for v in last], axis=0)
    dx, dy = x1 - x0, y1 - y0
    if max(abs(dx), abs(dy)) >= min_travel:
        if abs(dx) >= abs(dy):
            return "right" if dx > 0 else "left"
        return "down" if dy > 0 else "up"
    growth = np.mean([v.area for v in last]) / max(np.mean([v.area for v in first]), 1e-9)
    if growth >= min_growth:
        return "growing"
    if growth <= 1 / min_growth:
        return "shrinking"
    return "still"

"""Reading and writing media files: PNG with generation settings, MP4 through imageio-ffmpeg."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
from PIL.PngImagePlugin import PngInfo

from pipelines.requests import IMAGE_SUFFIXES


def save_png(image: PIL.Image.Image, path: str | Path, settings: dict[str, Any]) -> Path:
    """Write `image` as PNG with each setting as a text chunk (and all of them as JSON under 'parameters')."""
    info = PngInfo()
    for key, value in settings.items():
        info.add_text(key, "" if value is None else str(value))
    info.add_text("parameters", json.dumps(settings, sort_keys=True))
    path = Path(path)
    image.save(path, format="PNG", pnginfo=info)
    return path


def read_png_settings(path: str | Path) -> dict[str, Any]:
    """The settings `save_png` stored in a PNG."""
    with PIL.Image.open(path) as image:
        return json.loads(image.text["parameters"])


def save_mp4(frames: np.ndarray, path: str | Path, fps: int) -> Path:
    """Write uint8 frames [T, H, W, 3] as H.264 MP4 with imageio-ffmpeg's bundled ffmpeg."""
    import imageio.v2 as imageio

    path = Path(path)
    # macro_block_size=1: keep the exact size (tiny models make sizes that are not multiples of 16).
    # yuv444p would be lossless-er but many players refuse it; yuv420p needs even sizes, which all our sizes are.
    with imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8,
                            macro_block_size=1, pixelformat="yuv420p") as writer:
        for frame in frames:
            writer.append_data(frame)
    return path


def read_video(path: str | Path) -> tuple[list[np.ndarray], float]:
    """All frames of a video file and its frame rate."""
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        fps = float(reader.get_meta_data().get("fps", 0.0))
        frames = [np.asarray(frame) for frame in reader]
    return frames, fps


def read_frames(path: str | Path) -> list[PIL.Image.Image]:
    """An image file as one frame, or a video file's frames, as RGB PIL images."""
    path = Path(path)
    if path.suffix.lower() in IMAGE_SUFFIXES:
        with PIL.Image.open(path) as image:
            return [image.convert("RGB")]
    frames, _ = read_video(path)
    return [PIL.Image.fromarray(frame).convert("RGB") for frame in frames]

"""Reading and writing media files: PNG with generation settings, MP4 through imageio-ffmpeg, and the
checked, memory-bounded reading of a request's input image or video.

An input file is probed (its header only: size, duration) and held to INPUT_LIMITS before it is
decoded (a large image that would expand far past its file's size, a decompression bomb, is refused), and then decoded
frame by frame: only the frames a request uses are kept, each resized to the request's size as it arrives, and a video
is entered near its end (ffmpeg's -sseof) because video-to-world uses its last frames. A 20-second 1080p clip so costs
the memory of a few small frames, not of 600 full ones.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
from PIL.PngImagePlugin import PngInfo

from pipelines.media_suffixes import IMAGE_SUFFIXES


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """The largest input image or video a request may bring."""

    image_pixels: int = 50_000_000
    """An image's width x height (a 50-megapixel photo; PIL's own bomb check stops at 179 million)."""
    bomb_pixels: int = 8_000_000
    """Above this width x height, an image may not expand past `bomb_expansion` times its file once decoded."""
    bomb_expansion: int = 200
    """How many times its file's bytes a large image's decoded RGB pixels may take: a photo takes about 10 (JPEG)
    or 2-4 (PNG), a screenshot under 100; a decompression bomb (a small file of one colour that decodes to tens of
    megapixels, hundreds of MB on a rank) thousands."""
    video_side: int = 4096
    """A video's width and height each (4K)."""
    video_seconds: float = 300.0


INPUT_LIMITS = InputLimits()


class MediaError(ValueError):
    """An input file that cannot be used; the message names the file by its name only (never a server path)."""


@dataclass(frozen=True, kw_only=True)
class MediaInfo:
    """What a file's header says."""

    width: int
    height: int
    video: bool
    fps: float | None = None
    seconds: float | None = None


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


def mp4_writer_missing() -> str | None:
    """Why MP4 files cannot be written here (None: they can): save_mp4 needs imageio-ffmpeg and an ffmpeg it
    can run. Asked before any model loads, so that a video is never computed only to fail at its file."""
    try:
        import imageio_ffmpeg
    except ImportError:
        return "imageio-ffmpeg is not installed (pip install imageio-ffmpeg)"
    try:
        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as error:
        return f"imageio-ffmpeg finds no ffmpeg: {error}"
    if shutil.which(exe) is None:  # IMAGEIO_FFMPEG_EXE is taken as given, unchecked
        return f"ffmpeg {exe} (IMAGEIO_FFMPEG_EXE) is not an executable file"
    return None


def save_mp4(frames: np.ndarray, path: str | Path, fps: int, settings: dict[str, Any] | None = None) -> Path:
    """Write uint8 frames [T, H, W, 3] as H.264 MP4 with imageio-ffmpeg's bundled ffmpeg; `settings` as JSON
    in the file's comment tag (read_mp4_settings)."""
    import imageio.v2 as imageio

    path = Path(path)
    tags = ["-metadata", f"comment={json.dumps(settings, sort_keys=True)}"] if settings else []
    # macro_block_size=1: keep the exact size (tiny models make sizes that are not multiples of 16).
    # yuv444p would be lossless-er but many players refuse it; yuv420p needs even sizes, which all our sizes are.
    with imageio.get_writer(path, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8,
                            macro_block_size=1, pixelformat="yuv420p", output_params=tags) as writer:
        for frame in frames:
            writer.append_data(frame)
    return path


def read_mp4_settings(path: str | Path) -> dict[str, Any]:
    """The settings `save_mp4` stored in an MP4 (through the bundled ffmpeg's metadata export)."""
    import subprocess

    import imageio_ffmpeg

    exported = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path),
                               "-f", "ffmetadata", "-"],
                              capture_output=True, text=True, check=True).stdout
    for line in exported.splitlines():
        if line.startswith("comment="):
            return json.loads(re.sub(r"\\(.)", r"\1", line.removeprefix("comment=")))  # ffmetadata's escapes
    raise ValueError(f"{path} carries no settings")


def read_video(path: str | Path) -> tuple[list[np.ndarray], float]:
    """All frames of a (small) video file and its frame rate: for reading results back, not inputs."""
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        fps = float(reader.get_meta_data().get("fps", 0.0))
        frames = [np.asarray(frame) for frame in reader]
    return frames, fps


EXIF_ORIENTATION = 0x0112
"""The EXIF tag that says how a camera held the picture (values 5 to 8: turned a quarter, width and height swap)."""


def _turned(image: PIL.Image.Image) -> bool:
    """Whether `image`'s EXIF orientation turns it a quarter (its upright width is its stored height)."""
    return image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)


def open_image(path: str | Path) -> PIL.Image.Image:
    """An input image as RGB, upright by its EXIF orientation (a phone's photo), as diffusers' load_image gives it."""
    with PIL.Image.open(path) as image:
        return PIL.ImageOps.exif_transpose(image).convert("RGB")


def probe(path: str | Path) -> MediaInfo:
    """Size (and for a video frame rate and duration) from `path`'s header, decoding nothing."""
    path = Path(path)
    if path.suffix.lower() in IMAGE_SUFFIXES:
        try:
            # its size as stored (a phone's photo may be turned a quarter: no check here minds which side is which)
            with PIL.Image.open(path) as image:
                width, height = image.size
        except PIL.Image.DecompressionBombError:  # PIL refuses to open an image over twice its MAX_IMAGE_PIXELS
            raise MediaError(f"input image {path.name} is over {2 * PIL.Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels; "
                             f"the limit is {INPUT_LIMITS.image_pixels / 1e6:.0f} megapixels") from None
        except (OSError, ValueError) as error:
            raise MediaError(f"input file {path.name} is not an image this server can read "
                             f"({type(error).__name__})") from None
        return MediaInfo(width=width, height=height, video=False)
    import imageio_ffmpeg

    frames = imageio_ffmpeg.read_frames(str(path))
    try:
        meta = next(frames)  # ffmpeg's header report; closing the generator stops ffmpeg before it decodes
    except (OSError, RuntimeError, StopIteration):
        raise MediaError(f"input file {path.name} is not a video this server can read") from None
    finally:
        frames.close()
    width, height = meta.get("source_size") or meta["size"]
    duration = meta.get("duration")
    return MediaInfo(width=width, height=height, video=True, fps=meta.get("fps") or None,
                     seconds=float(duration) if duration and duration != float("inf") else None)


def check_input(path: str | Path, limits: InputLimits = INPUT_LIMITS) -> MediaInfo:
    """probe(path), or MediaError saying which limit it is over (checked before anything is decoded)."""
    info = probe(path)
    name = Path(path).name
    pixels = info.width * info.height
    if not info.video and pixels > limits.image_pixels:
        raise MediaError(f"input image {name} is {info.width}x{info.height} ({pixels / 1e6:.0f} "
                         f"megapixels); the limit is {limits.image_pixels / 1e6:.0f} megapixels")
    expansion = 3 * pixels / max(Path(path).stat().st_size, 1)
    if not info.video and pixels > limits.bomb_pixels and expansion > limits.bomb_expansion:
        raise MediaError(f"input image {name} is {info.width}x{info.height} ({pixels / 1e6:.0f} megapixels) from a "
                         f"file of {Path(path).stat().st_size / 1e3:.0f} kB: {expansion:.0f} times its size once "
                         f"decoded, a decompression bomb; above {limits.bomb_pixels / 1e6:.0f} megapixels an image may "
                         f"expand {limits.bomb_expansion} times at most")
    if info.video and max(info.width, info.height) > limits.video_side:
        raise MediaError(f"input video {name} is {info.width}x{info.height}; the limit is {limits.video_side} "
                         f"pixels a side")
    if info.video and info.seconds is not None and info.seconds > limits.video_seconds:
        raise MediaError(f"input video {name} lasts {info.seconds:.0f} s; the limit is {limits.video_seconds:.0f} s")
    return info


def read_frames(path: str | Path, size: tuple[int, int], *, last: int = 1,
                resample: int = PIL.Image.Resampling.LANCZOS) -> list[PIL.Image.Image]:
    """The last `last` frames of a video (an image is one frame), RGB, each resized to `size` (width, height)
    as it is decoded: memory holds `last` frames of `size` and one decoded frame, whatever the file's length.

    The file is held to INPUT_LIMITS first (MediaError).
    """
    path = Path(path)
    info = check_input(path)
    if not info.video:
        with PIL.Image.open(path) as image:
            # a JPEG decodes at a reduced scale where that is still >= size (in its stored orientation)
            image.draft("RGB", size[::-1] if _turned(image) else size)
            return [PIL.ImageOps.exif_transpose(image).convert("RGB").resize(size, resample)]
    import imageio_ffmpeg

    input_params = []
    if info.fps and info.seconds:
        tail = (last + 2) / info.fps + 0.5  # a margin of frames: -sseof lands on a frame boundary
        if info.seconds > tail + 1:
            input_params = ["-sseof", f"-{tail:.3f}"]
    kept: deque[PIL.Image.Image] = deque(maxlen=last)
    frames = imageio_ffmpeg.read_frames(str(path), input_params=input_params)
    try:
        meta = next(frames)
        width, height = meta["size"]
        for raw in frames:
            frame = PIL.Image.frombuffer("RGB", (width, height), raw, "raw", "RGB", 0, 1)
            kept.append(frame.resize(size, resample))
    except (OSError, RuntimeError) as error:
        raise MediaError(f"input video {path.name} could not be decoded ({type(error).__name__})") from None
    finally:
        frames.close()
    if not kept:
        raise MediaError(f"input video {path.name} has no frames")
    return list(kept)

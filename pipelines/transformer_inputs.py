"""A family's transformer called at one size: its keyword arguments, random values of the right shapes.

Each family's record names its builder (BenchShapes.inputs). The work estimate (pipelines.work) counts
a request's FLOPs on meta tensors built by it; the benchmarks time real calls built by it. A builder
takes the transformer's config (a dict), a Shape, and batch / device / dtype, and returns the keyword
arguments and the number of image or video tokens the call attends over. Each family keeps its builder in its
folder (pipelines/<family>/inputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

VAE_TIME, VAE_SPACE = 4, 8  # latent = ((frames - 1) / 4 + 1, height / 8, width / 8)


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One input size: an image (frames=1) or a video, in pixels."""

    height: int
    width: int
    frames: int = 1
    text_tokens: int = 512
    reference: tuple[int, int] | None = None
    """A reference image's height and width in pixels, whose tokens follow the image's (an editing checkpoint's), or
    None; the builders of families without one leave it out."""

    @property
    def label(self) -> str:
        """Human-readable size."""
        return f"{self.height}x{self.width}" if self.frames == 1 else f"{self.frames}x{self.height}x{self.width}"



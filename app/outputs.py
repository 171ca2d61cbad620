"""Output files: which extension a model's media takes, checks before work starts, and writing."""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.registry import ModelSpec
from pipelines.requests import GenerationRequest

EXTENSIONS = {"image": ".png", "video": ".mp4"}


class OutputError(ValueError):
    """An output path that cannot receive the result."""


def check_output_path(path: str | Path, spec: ModelSpec) -> Path:
    """`path` if the result of `spec` can be written there; OutputError otherwise (before any work)."""
    path = Path(path).expanduser()
    wanted = EXTENSIONS[spec.media]
    if path.suffix.lower() != wanted:
        raise OutputError(
            f"output {path} should end in {wanted}: model '{spec.name}' makes {spec.media}s"
        )
    parent = path.parent.resolve()
    if not parent.is_dir():
        raise OutputError(f"cannot write {path}: folder {parent} does not exist")
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"cannot write {path}: permission denied")
    return path


def settings_of(request: GenerationRequest, spec: ModelSpec) -> dict[str, Any]:
    """What a result file records about how it was made."""
    settings = {"model": spec.name, **request.to_dict()}
    if spec.media == "image":
        settings.pop("frames")
        settings.pop("fps")
    return settings


def write_result(result: Any, path: Path, request: GenerationRequest, spec: ModelSpec) -> Path:
    """Write a pipeline result (PIL image or uint8 frames) to `path` as PNG or MP4."""
    from pipelines.media import save_mp4, save_png

    if spec.media == "image":
        return save_png(result, path, settings_of(request, spec))
    return save_mp4(result, path, request.fps)


@dataclass(frozen=True)
class Result:
    """One written result file and the settings that made it."""

    path: Path
    settings: dict[str, Any]


class RecentResults:
    """A server's latest results per model, newest first (the UI's recent-results galleries)."""

    def __init__(self, keep: int = 24) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._results: dict[str, deque[Result]] = {}

    def add(self, model: str, path: Path, settings: dict[str, Any]) -> None:
        with self._lock:
            self._results.setdefault(model, deque(maxlen=self._keep)).appendleft(Result(path, settings))

    def of(self, model: str) -> list[Result]:
        with self._lock:
            return list(self._results.get(model, ()))

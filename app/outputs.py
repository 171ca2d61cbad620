"""Output files: which extension a model's media takes, checks before work starts, writing, and a
server's results folder with its optional cap."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.registry import ModelSpec
from pipelines.requests import GenerationRequest

EXTENSIONS = {"image": ".png", "video": ".mp4"}


class OutputError(ValueError):
    """An output path that cannot receive the result."""


def check_writer(spec: ModelSpec) -> None:
    """OutputError if this machine cannot write `spec`'s results (an MP4 needs imageio-ffmpeg's ffmpeg)."""
    from pipelines.media import mp4_writer_missing

    if spec.media == "video" and (missing := mp4_writer_missing()):
        raise OutputError(f"model '{spec.name}' makes MP4 videos, which cannot be written here: {missing}")


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
    check_writer(spec)
    return path


def check_results_folder(folder: str | Path) -> Path:
    """`folder` (made when the first result is written) if results can be written into it; OutputError otherwise,
    before any rank starts: a file in its place or on its path, or a folder this user may not write."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"--out {folder} is a file, not a folder")
    nearest = next(path for path in (folder.absolute(), *folder.absolute().parents) if path.exists())
    if not nearest.is_dir():
        raise OutputError(f"--out {folder} cannot be made: {nearest} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise OutputError(f"--out {folder} cannot be written: permission denied in {nearest}")
    return folder


def settings_of(request: GenerationRequest, spec: ModelSpec, computed_steps: int | None = None,
                ran_on: dict[str, str] | None = None) -> dict[str, Any]:
    """What a result file records about how it was made; `computed_steps`: of a request run with a step cache,
    the steps whose transformer blocks all ran (the others reused the cache); `ran_on`: the group of ranks and
    the plan that ran it ({"group": ..., "plan": ...}), where the ranks form several groups."""
    settings = {"model": spec.name, **request.to_dict(), **(ran_on or {})}
    if computed_steps is None:  # run without a step cache: the request's choice had no effect
        settings.pop("step_cache")
    else:
        settings["computed_steps"] = computed_steps
    if request.lora:  # the LoRAs that made it and their scales; none: no key, as before LoRAs existed
        settings["lora"] = dict(request.lora)
    else:
        settings.pop("lora")
    if request.condition is not None:  # the input by its name: where it was kept is no business of the file's
        settings["condition"] = Path(request.condition).name
    if spec.media == "image":
        settings.pop("frames")
        settings.pop("fps")
    return settings


def write_result(result: Any, path: Path, request: GenerationRequest, spec: ModelSpec,
                 computed_steps: int | None = None, ran_on: dict[str, str] | None = None) -> Path:
    """Write a pipeline result (PIL image or uint8 frames) to `path` as PNG or MP4, with its settings."""
    from pipelines.media import save_mp4, save_png

    settings = settings_of(request, spec, computed_steps, ran_on)
    if spec.media == "image":
        return save_png(result, path, settings)
    return save_mp4(result, path, request.fps, settings)


@dataclass(frozen=True)
class Result:
    """One written result file and the settings that made it."""

    path: Path
    settings: dict[str, Any]


@dataclass(frozen=True)
class ResultsCap:
    """What a server keeps in its results folder: at most a number of files, of bytes, or an age (with its jobs'
    rows: app.server.job_store); any of them, together."""

    files: int | None = None
    bytes: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> ResultsCap:
        """'500' -> 500 files; '2GB', '500MB', '1.5G' -> bytes (1 GB = 10^9 bytes); '24h', '7d' -> an age;
        several, comma-separated ('2GB,7d'): each holds."""
        caps: dict[str, float] = {}
        for part in text.split(","):
            match = re.fullmatch(r"(\d+)|(\d+(?:\.\d+)?)\s*([kmgt])b?|(\d+(?:\.\d+)?)\s*([hd])", part.strip().lower())
            if match is None:
                raise ValueError(f"expected a number of files (e.g. 500), a size (e.g. 2GB) or an age (e.g. 24h, "
                                 f"7d), got {part.strip()!r}")
            if match[1]:
                caps["files"] = int(match[1])
            elif match[2]:
                caps["bytes"] = int(float(match[2]) * 1000 ** ("kmgt".index(match[3]) + 1))
            else:
                caps["seconds"] = float(match[4]) * (3600 if match[5] == "h" else 86400)
            if min(caps.values()) <= 0 or caps.get("files", 1) < 1 or caps.get("bytes", 1) < 1:
                raise ValueError(f"a results cap keeps at least one file, got {text!r}")
        return cls(**caps)

    def __str__(self) -> str:
        parts = [f"{self.files} files" if self.files is not None else "",
                 f"{self.bytes / 1e6:g} MB" if self.bytes is not None else "",
                 f"{self.seconds / 3600:g} h" if self.seconds is not None else ""]
        return ", ".join(part for part in parts if part)


RESULT_NAME = re.compile(r"[a-z]+-\d{8}-\d{6}-(?:[0-9a-f]{32}|[0-9a-f]{6})-seed\d+\.(?:png|mp4)")
"""How ResultsFolder names its files (what its cap may remove: nothing else in the folder); a name's 32 hex
digits are its secret where the UI serves files without a login (older servers wrote 6)."""


class ResultsFolder:
    """Where a server writes its results, named `<media>-<date>-<time>-<id>-seed<seed>.<ext>` (id: 32 random hex
    digits); with a cap, the oldest of those (by modification time) go once there are more than the cap allows,
    or once they are older than its age."""

    def __init__(self, folder: Path, cap: ResultsCap | None = None) -> None:
        self.folder = folder
        self.cap = cap
        self._lock = threading.Lock()

    def write(self, result: Any, request: GenerationRequest, spec: ModelSpec, computed_steps: int | None = None,
              ran_on: dict[str, str] | None = None) -> Path:
        """Write a result under a new name (write_result); the caller then holds the folder to its cap (prune)."""
        name = f"{spec.media}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex}-seed{request.seed}"
        return write_result(result, self.folder / f"{name}{EXTENSIONS[spec.media]}", request, spec, computed_steps,
                            ran_on)

    def prune(self, keep: Path | None = None, now: float | None = None) -> list[Path]:
        """Remove the oldest results beyond the cap, and those past its age (never `keep`, the newest); returns what
        went."""
        if self.cap is None:
            return []
        now = time.time() if now is None else now
        with self._lock:
            results = []
            for path in self.folder.iterdir():
                if RESULT_NAME.fullmatch(path.name) and path.is_file():
                    stat = path.stat()
                    results.append((stat.st_mtime, stat.st_size, path))
            results.sort(reverse=True)  # newest first
            removed, count, size = [], 0, 0
            for mtime, bytes_, path in results:
                count, size = count + 1, size + bytes_
                over = ((self.cap.files is not None and count > self.cap.files)
                        or (self.cap.bytes is not None and size > self.cap.bytes)
                        or (self.cap.seconds is not None and now - mtime > self.cap.seconds))
                if over and path != keep:
                    path.unlink(missing_ok=True)
                    removed.append(path)
            return removed


class RecentResults:
    """A server's latest results per model and owner (app.server.ui.Owners), newest first (the UI's galleries)."""

    def __init__(self, keep: int = 24, owners: int = 1000) -> None:
        self._keep = keep
        self._owners = owners
        self._lock = threading.Lock()
        self._results: dict[tuple[str, str], deque[Result]] = {}
        """(model, owner) -> results; dict order: least recently added to first, dropped beyond `owners`."""

    def add(self, model: str, owner: str, path: Path, settings: dict[str, Any]) -> None:
        with self._lock:
            results = self._results.pop((model, owner), None) or deque(maxlen=self._keep)
            results.appendleft(Result(path, settings))
            self._results[(model, owner)] = results
            while len(self._results) > self._owners:
                del self._results[next(iter(self._results))]

    def of(self, model: str, owner: str) -> list[Result]:
        """The owner's recent results of the model whose files still exist (a results cap may have removed some)."""
        with self._lock:
            return [result for result in self._results.get((model, owner), ()) if result.path.is_file()]

"""A server's uploads: Gradio's upload folder, private to the server, and each upload deleted once used.

The server points Gradio's cache (GRADIO_TEMP_DIR) at a folder of its own (app.ranks.stopping's
temporary_folder) and removes it on exit, so nothing a client sent outlives the server; an upload a
request used is deleted as soon as that request ends. Gradio stores uploads by content (the same
bytes land on the same path), so an upload is counted while requests use it and goes with the last. An upload
no request uses goes once it is UNUSED_SECONDS old (sweep, run by the server's housekeeping every few seconds):
Gradio's own sweep of its cache is hourly.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from pathlib import Path

UNUSED_SECONDS = 50.0
"""Age past which an upload no request uses is deleted (sweep): within a minute, with the housekeeping's period."""
ORPHAN_SECONDS = 2.0
"""Age past which an empty temporary file at the top of the upload folder is an orphan (see remove_orphans)."""


def _remove_if_empty(folder: Path) -> None:
    """Remove `folder` if it is empty: rmdir alone decides, so that an upload Gradio stores there meanwhile stays
    (a look first, then the removal, would race with it)."""
    with contextlib.suppress(OSError):  # not empty, or gone already
        folder.rmdir()


class Uploads:
    """The uploads under `folder` that running or waiting requests use."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self._users: Counter[Path] = Counter()
        self._lock = threading.Lock()

    def holds(self, path: str | Path) -> bool:
        """Whether `path` is an upload (a file in this server's upload folder)."""
        return Path(path).resolve().is_relative_to(self.folder)

    def use(self, path: str | Path) -> None:
        """A request uses the upload at `path` (files elsewhere are not uploads and are left alone)."""
        if self.holds(path):
            with self._lock:
                self._users[Path(path).resolve()] += 1

    def release(self, path: str | Path) -> None:
        """A request that used `path` ended: delete the upload if no other request uses it."""
        path = Path(path).resolve()
        with self._lock:
            if path not in self._users:
                return
            self._users[path] -= 1
            if self._users[path] > 0:
                return
            del self._users[path]
            path.unlink(missing_ok=True)
            folder = path.parent
            if folder != self.folder and folder.is_relative_to(self.folder):
                _remove_if_empty(folder)  # Gradio's per-upload folder

    def sweep(self, max_age: float = UNUSED_SECONDS, now: float | None = None) -> list[Path]:
        """Delete the uploads older than `max_age` seconds that no request uses, and the folders they leave empty;
        returns the files deleted."""
        now = time.time() if now is None else now
        removed = []
        with self._lock:
            for path in sorted(self.folder.rglob("*"), key=lambda found: len(found.parts), reverse=True):
                try:
                    stat = path.lstat()
                except OSError:
                    continue
                if now - stat.st_mtime <= max_age or path.resolve() in self._users:
                    continue
                if path.is_dir() and not path.is_symlink():
                    _remove_if_empty(path)
                else:
                    path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def remove_orphans(self, now: float | None = None) -> list[Path]:
        """Delete the empty temporary files Gradio leaves at the top of its folder (returns them).

        gradio.File(type="filepath") makes an empty NamedTemporaryFile for every file it preprocesses and keeps
        only its name (gradio 6.31, components/file.py): one orphan per request that brings a file. An upload
        in flight also starts as a top-level temporary file, but holds data within milliseconds, so an empty
        one older than ORPHAN_SECONDS is no upload's."""
        now = time.time() if now is None else now
        removed = []
        for path in self.folder.iterdir():
            try:
                stat = path.stat()
            except OSError:
                continue
            if (path.name.startswith("tmp") and path.is_file() and stat.st_size == 0
                    and now - stat.st_mtime > ORPHAN_SECONDS):
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

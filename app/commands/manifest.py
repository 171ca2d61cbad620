"""The batch manifest: one JSON line per written file, with its settings and timings.

It is also what makes a batch resumable: an item is done when the manifest lists its file with the
same settings and the file exists. Lines are appended and flushed one at a time, after the file is in
place, so an interrupted run leaves at worst a torn last line, which is ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.jsonl"


class Manifest:
    """manifest.jsonl in an output folder, read once when opened and appended to as files are written."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.path = folder / MANIFEST_NAME
        self._written = {entry["file"]: entry.get("settings") for entry in self.entries()}

    def entries(self) -> list[dict[str, Any]]:
        """Every complete entry in the file, in order (a torn or foreign line is skipped)."""
        if not self.path.exists():
            return []
        entries = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("file"), str):
                entries.append(entry)
        return entries

    def is_done(self, file: str, settings: dict[str, Any]) -> bool:
        """True if `file` was written with exactly `settings` and is still there."""
        return self._written.get(file) == settings and (self.folder / file).is_file()

    def append(self, entry: dict[str, Any]) -> None:
        """Add one entry, durably."""
        # After an interrupted run's torn last line, a line of its own: else the two would be one bad line.
        start = "\n" if self._ends_torn() else ""
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(start + json.dumps(entry, sort_keys=True) + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        self._written[entry["file"]] = entry.get("settings")

    def _ends_torn(self) -> bool:
        """Whether the file's last line has no newline (an interrupted run's torn line)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return False
        with self.path.open("rb") as stream:
            stream.seek(-1, os.SEEK_END)
            return stream.read(1) != b"\n"

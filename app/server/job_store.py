"""The job store: one SQLite file (WAL) in the results folder, the memory of every request a server takes.

Every request, the UI's and the API's, is a row, written before its job is queued and as it moves: its owner
(the API key or UI login that made it), model, request fields, status (queued, in_progress, completed, failed),
progress, times, files and error. The file, not the process, is the truth: after any stop (Ctrl-C, SIGTERM,
kill -9, a dead rank) the next start reads it back (recover): the job that was running is failed with
INTERRUPTED, the queued ones are queued again, the completed ones stay retrievable by id with their files until
they expire. Each change is one transaction with synchronous=FULL, so a row written is on disk before the
server answers, and a kill -9 at any moment leaves the file whole (SQLite's journal).

Status changes go through JobStore.change alone, which tells every subscriber (subscribe) the row as it now is:
the hook for whatever must hear of a job's moves (webhooks, metrics).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

STORE_NAME = "jobs.sqlite3"
"""The store's file name in the results folder."""
INTERRUPTED = "interrupted by a server restart"
STATUSES = ("queued", "in_progress", "completed", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    settings TEXT,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    expires_at REAL,
    upload_bytes INTEGER NOT NULL DEFAULT 0,
    error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, kind, seq);
CREATE TABLE IF NOT EXISTS files (
    name TEXT PRIMARY KEY,
    job TEXT NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_job ON files (job);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(kw_only=True)
class JobRow:
    """One request as the store keeps it."""

    id: str
    owner: str
    """Who made it: "key:<hash of the API key>", "user:<login>", "browser:<id>", or "anyone" (an open API)."""
    kind: str
    """"image" or "video" (a video is retrieved by id; an image is answered in its request)."""
    model: str
    """The served model's name."""
    request: dict[str, Any]
    """The request's fields (make_request's): enough to queue it again after a restart."""
    status: str = "queued"
    progress: int = 0
    settings: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    completed_at: float | None = None
    """When it ended (completed or failed), epoch seconds."""
    expires_at: float | None = None
    """When its files and row go (--keep-results AGE); None: not by age."""
    upload_bytes: int = 0
    """The size of the upload it holds while it waits or runs."""
    error: dict[str, str] | None = None
    """{"code", "message"} of a failed job."""
    files: list[str] = field(default_factory=list)
    """Its result files' names, in the results folder."""


_JSON = {"request", "settings", "error"}
_COLUMNS = [f.name for f in fields(JobRow) if f.name != "files"]


class JobStore:
    """The jobs of a server in the SQLite file at `path` (created where missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._listeners: list[Callable[[JobRow], None]] = []

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def subscribe(self, listener: Callable[[JobRow], None]) -> None:
        """Call `listener` with the row after every change of a job's status (in the changing thread)."""
        self._listeners.append(listener)

    def add(self, row: JobRow) -> JobRow:
        with self._lock:
            values = [self._column(name, getattr(row, name)) for name in _COLUMNS]
            self._db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                             values)
        self._tell(row)
        return row

    def change(self, job_id: str, **changes: Any) -> JobRow | None:
        """Set a job's fields (status, progress, settings, times, error; `files`: {name: bytes} of its results);
        the one way a job moves. Subscribers hear of a new status. None where the row is gone (deleted)."""
        files = changes.pop("files", None)
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise ValueError(f"no job field {sorted(unknown)[0]!r}")
        if changes.get("status", "queued") not in STATUSES:
            raise ValueError(f"no job status {changes['status']!r}")
        with self._lock:
            before = self._get(job_id)
            if before is None:
                return None
            if changes:
                assignments = ", ".join(f"{name} = ?" for name in changes)
                values = [self._column(name, value) for name, value in changes.items()]
                self._db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", [*values, job_id])
            if files:
                self._db.executemany("INSERT OR REPLACE INTO files (name, job, bytes) VALUES (?, ?, ?)",
                                     [(name, job_id, size) for name, size in files.items()])
            row = self._get(job_id)
        if row is not None and row.status != before.status:
            self._tell(row)
        return row

    def get(self, job_id: str) -> JobRow | None:
        with self._lock:
            return self._get(job_id)

    def owner_of_file(self, name: str) -> str | None:
        """The owner of the job whose result `name` is (None: no job's)."""
        with self._lock:
            found = self._db.execute("SELECT jobs.owner FROM files JOIN jobs ON jobs.id = files.job "
                                     "WHERE files.name = ?", (name,)).fetchone()
        return None if found is None else found[0]

    def page(self, owner: str | None, kind: str, *, after: str | None = None, limit: int = 20,
             order: str = "desc") -> tuple[list[JobRow], bool]:
        """`owner`'s jobs of `kind` (None: everyone's), `limit` of them after the job `after` in `order` of creation;
        and whether more follow."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        query, values = "SELECT * FROM jobs WHERE kind = ?", [kind]
        if owner is not None:
            query, values = query + " AND owner = ?", [*values, owner]
        with self._lock:
            if after is not None:
                found = self._db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
                if found is None:
                    raise KeyError(after)
                query, values = query + f" AND seq {'<' if order == 'desc' else '>'} ?", [*values, found[0]]
            query += f" ORDER BY seq {order.upper()} LIMIT ?"
            rows = [self._row(found) for found in self._db.execute(query, [*values, limit + 1]).fetchall()]
        return rows[:limit], len(rows) > limit

    def delete(self, job_id: str) -> JobRow | None:
        """Forget a job and its files' names (the caller removes the files); returns the row it was."""
        with self._lock:
            row = self._get(job_id)
            self._db.execute("DELETE FROM files WHERE job = ?", (job_id,))
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        return row

    def recover(self) -> list[JobRow]:
        """At start-up: fail the jobs that were running (INTERRUPTED) and return the queued ones, oldest first."""
        with self._lock:
            running = [found[0] for found in self._db.execute("SELECT id FROM jobs WHERE status = 'in_progress'")]
        for job_id in running:
            self.change(job_id, status="failed", completed_at=time.time(),
                        error={"code": "interrupted", "message": INTERRUPTED})
        with self._lock:
            return [self._row(found) for found in
                    self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq").fetchall()]

    def evict(self, now: float | None = None, files: list[str] | None = None) -> list[JobRow]:
        """Delete the jobs past their expires_at, and those whose results are among `files` (removed by the
        results cap); returns them (their files for the caller to remove)."""
        now = time.time() if now is None else now
        with self._lock:
            ids = [found[0] for found in self._db.execute(
                "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))]
            for name in files or []:
                found = self._db.execute("SELECT job FROM files WHERE name = ?", (name,)).fetchone()
                if found is not None:
                    ids.append(found[0])
        return [row for row in (self.delete(job_id) for job_id in dict.fromkeys(ids)) if row is not None]

    def usage(self, owner: str) -> tuple[int, int]:
        """(bytes of uploads its waiting and running jobs hold, bytes of its result files)."""
        with self._lock:
            uploads = self._db.execute("SELECT COALESCE(SUM(upload_bytes), 0) FROM jobs WHERE owner = ? AND status IN "
                                       "('queued', 'in_progress')", (owner,)).fetchone()[0]
            results = self._db.execute("SELECT COALESCE(SUM(files.bytes), 0) FROM files JOIN jobs ON jobs.id = "
                                       "files.job WHERE jobs.owner = ?", (owner,)).fetchone()[0]
        return uploads, results

    def secret(self) -> bytes:
        """The server's secret for signed URLs, made once and kept here, so that a URL outlives a restart."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('url_secret', ?)",
                             (secrets.token_hex(32),))
            return bytes.fromhex(self._db.execute("SELECT value FROM meta WHERE key = 'url_secret'").fetchone()[0])

    def _tell(self, row: JobRow) -> None:
        for listener in self._listeners:
            listener(row)

    @staticmethod
    def _column(name: str, value: Any) -> Any:
        return json.dumps(value) if name in _JSON and value is not None else value

    def _get(self, job_id: str) -> JobRow | None:
        found = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if found is None else self._row(found)

    def _row(self, found: sqlite3.Row) -> JobRow:
        values = dict(found)
        values.pop("seq")
        for name in _JSON:
            if values[name] is not None:
                values[name] = json.loads(values[name])
        values["files"] = [name for (name,) in self._db.execute("SELECT name FROM files WHERE job = ? ORDER BY name",
                                                                (values["id"],))]
        return JobRow(**values)

"""What can end a request or a run, as exceptions (light: no torch import, so the CLI can catch them)."""

from __future__ import annotations


class JobFailed(Exception):
    """Every rank dropped the request; the message says which rank failed and why. The service goes on."""


class JobCancelled(JobFailed):
    """A stop was asked for (Ctrl-C, SIGTERM) on some rank; every rank dropped the request."""


class RankLost(RuntimeError):
    """Another rank died or stopped answering: the run cannot go on and must end."""


class StartupError(RuntimeError):
    """A rank could not load a model; every rank stops before serving anything."""


def describe(error: BaseException) -> str:
    """One line for a person: the exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")

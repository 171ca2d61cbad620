"""Acceptance checks that need GPUs (run through the device machines; see each module's docstring)."""

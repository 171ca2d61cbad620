"""Rank 0's recent text encodings: a request whose prompt was encoded lately skips the text encoders.

A server sees the same prompt again and again (new seeds, other sizes, a batch file's variations); a
FLUX.1-dev prompt costs a T5-XXL forward each time. Entries are the encoder outputs as computed (on the
device), keyed by everything the encoding depends on (the pipeline's `cached_text` callers say what).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_PROMPT_CACHE_ENTRIES = 16
"""A T5-XXL encoding of 512 tokens is 4 MiB in bf16: 16 of them are small beside the models."""


class PromptCache:
    """The `entries` most recently used encodings, the least recently used dropped first."""

    def __init__(self, entries: int = DEFAULT_PROMPT_CACHE_ENTRIES) -> None:
        if entries < 1:
            raise ValueError(f"a prompt cache holds at least one entry, got {entries}")
        self.entries = entries
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_compute(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The cached value of `key`, or compute() stored under it (an exception stores nothing)."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
        value = compute()
        with self._lock:
            self.misses += 1
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)

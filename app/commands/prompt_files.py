"""Prompt files for `batch`: .txt (one prompt a line), .jsonl and .csv with per-line overrides.

Fields a .jsonl object or a .csv column may set: prompt (required), negative_prompt, seed, size ("WxH") or
width/height, steps, guidance, guidance_2 (a two-expert model's second expert's), frames, fps, input (a conditioning
image or video, or a reference image, relative to the prompt file), name (the output file's name, sanitized), lora
(the run's --lora names this line uses, with scales: "style:0.8,detail" or in .jsonl {"style": 0.8}; "" none). A
line that cannot be read becomes a BadLine with its line number; the others are unaffected.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.commands.arguments import parse_size
from pipelines.requests import RequestError

SUFFIXES = (".txt", ".jsonl", ".csv")
FIELDS = ("prompt", "negative_prompt", "seed", "size", "width", "height", "steps", "guidance", "guidance_2", "frames",
          "fps", "input", "name", "step_cache", "quantized_attention", "lora")
MAX_NAME_CHARS = 100
PROMPT_NAME_CHARS = 40
"""The most characters of its prompt's words in an unnamed line's output file name."""


class BatchError(ValueError):
    """A prompt file or output folder that cannot be used at all."""


@dataclass(frozen=True)
class PromptLine:
    """One readable line: its number (1-based, in the file) and its fields, values as written."""

    line: int
    fields: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    """A line that cannot be used, and why."""

    line: int
    message: str


def read_prompt_file(path: Path) -> list[PromptLine | BadLine]:
    """Every prompt of `path` in file order; unreadable lines as BadLine."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise BatchError(f"{path}: prompt files are {', '.join(SUFFIXES)}, not '{suffix or path.name}'")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise BatchError(f"cannot read {path}: {error}") from None
    if suffix == ".txt":
        return [PromptLine(number, {"prompt": line.strip()})
                for number, line in enumerate(text.splitlines(), start=1)
                if line.strip() and not line.lstrip().startswith("#")]
    if suffix == ".jsonl":
        return [_jsonl_line(number, line) for number, line in enumerate(text.splitlines(), start=1)
                if line.strip()]
    return _csv_lines(text)


def _jsonl_line(number: int, line: str) -> PromptLine | BadLine:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        return BadLine(number, f"not valid JSON ({error.msg} at column {error.colno})")
    if not isinstance(fields, dict):
        return BadLine(number, "a .jsonl line must be a JSON object such as {\"prompt\": \"a red circle\"}")
    return _checked(number, fields)


def _csv_lines(text: str) -> list[PromptLine | BadLine]:
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or "prompt" not in [name.strip() for name in reader.fieldnames]:
        raise BatchError("a .csv prompt file needs a header row with a 'prompt' column")
    items: list[PromptLine | BadLine] = []
    for row in reader:
        number = reader.line_num
        if None in row:
            items.append(BadLine(number, f"more cells than the header has columns: {row[None]!r}"))
            continue
        fields = {key.strip(): value for key, value in row.items() if value is not None and value.strip() != ""}
        if fields:
            items.append(_checked(number, fields))
    return items


def _checked(number: int, fields: dict[str, Any]) -> PromptLine | BadLine:
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        return BadLine(number, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    if "size" in fields:
        try:
            parse_size(fields["size"])
        except RequestError:
            return BadLine(number, f"size must look like 768x512 (width x height), got {fields['size']!r}")
    return PromptLine(number, fields)


def request_fields(item: PromptLine, defaults: dict[str, Any], base: Path) -> dict[str, Any]:
    """make_request fields for `item`: the line's own values over the command line's `defaults`.

    `input` paths are relative to `base` (the prompt file's folder).
    """
    fields = dict(item.fields)
    fields.pop("name", None)
    if "size" in fields:
        fields["width"], fields["height"] = parse_size(fields.pop("size"))
    if "input" in fields:
        fields["condition"] = str(base / str(fields.pop("input")))
    return {**defaults, **{key: value for key, value in fields.items() if value is not None}}


def sanitize_name(raw: str) -> str:
    """A file-name stem made of letters, digits, '.', '_' and '-' only: no folders, no path escapes.

    Returns "" when nothing usable is left.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", raw.strip())
    return stem.strip(".-_")[:MAX_NAME_CHARS].strip(".-_")


def output_name(item: PromptLine, extension: str) -> str:
    """The output file name of `item`: its sanitized `name`, else line number and prompt words."""
    given = sanitize_name(str(item.fields.get("name", "")))
    if given.lower().endswith(extension):
        given = given[: -len(extension)]
    if not given:
        words = prompt_words(str(item.fields.get("prompt", "")))
        given = f"{item.line:04d}-{words}" if words else f"{item.line:04d}"
    return given + extension


def prompt_words(prompt: str, limit: int = PROMPT_NAME_CHARS) -> str:
    """The first whole words of `prompt` that fit in `limit` characters, sanitized and lowercase: a name that
    reads as the prompt does, not one cut mid-word; only a first word longer than `limit` is cut."""
    words = sanitize_name(prompt.lower())
    if len(words) > limit:
        # Spaces became '-': the last '-' at or before `limit` ends the last word that fits whole.
        words = words[:limit + 1].rpartition("-")[0] or words[:limit]
    return words.strip(".-_")

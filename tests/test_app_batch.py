"""`ulysses-studio batch`: prompt files, sanitized names, and an interrupted 2-rank batch resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image

from app.commands.prompt_files import (
    BadLine,
    PromptLine,
    output_name,
    prompt_words,
    read_prompt_file,
    request_fields,
    sanitize_name,
)
from tests.helpers import REPO

LINES = [
    '{"prompt": "a red circle", "seed": 1, "name": "red"}',
    '{"prompt": "a blue square", "seed": 2, "size": "64x32"}',
    '{"prompt": "green", "steps": 3, "name": "../../escape/attempt"}',
    '{"prompt": "a broken line", "seed": ',
    '{"prompt": "yellow", "guidance": 2.0, "name": "yellow.png"}',
    '{"prompt": "purple", "seed": 6}',
]
EXPECTED_FILES = {"red.png", "0002-a-blue-square.png", "escape-attempt.png", "yellow.png", "0006-purple.png"}


def test_txt_lines_skip_blanks_and_comments(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n\n# a comment\n  a dog  \n")
    assert read_prompt_file(prompts) == [PromptLine(1, {"prompt": "a cat"}), PromptLine(4, {"prompt": "a dog"})]


def test_csv_overrides_and_bad_rows_keep_their_line_numbers(tmp_path):
    prompts = tmp_path / "p.csv"
    prompts.write_text("prompt,seed,size,name\na cat,3,128x64,cat\na dog,,,\ntoo,many,cells,here,extra\n"
                       "bad size,1,big,\n")
    items = read_prompt_file(prompts)
    assert items[0] == PromptLine(2, {"prompt": "a cat", "seed": "3", "size": "128x64", "name": "cat"})
    assert items[1] == PromptLine(3, {"prompt": "a dog"})
    assert isinstance(items[2], BadLine) and items[2].line == 4
    assert isinstance(items[3], BadLine) and items[3].line == 5 and "size must look like" in items[3].message
    fields = request_fields(items[0], {"steps": 2, "seed": 0}, tmp_path)
    assert fields == {"steps": 2, "seed": "3", "width": 128, "height": 64, "prompt": "a cat"}


def test_jsonl_bad_lines_and_unknown_fields(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n[1, 2]\n{"prompt": "x", "colour": "red"}\n{not json\n')
    items = read_prompt_file(prompts)
    assert items[0] == PromptLine(1, {"prompt": "ok"})
    assert [item.line for item in items[1:]] == [2, 3, 4] and all(isinstance(i, BadLine) for i in items[1:])
    assert "unknown field(s) colour" in items[2].message


def test_output_names_cannot_leave_the_folder():
    assert sanitize_name("../../etc/passwd") == "etc-passwd"
    assert sanitize_name("/abs/path") == "abs-path"
    assert sanitize_name("..") == ""
    assert sanitize_name("a b\\c:d*e") == "a-b-c-d-e"
    assert output_name(PromptLine(7, {"prompt": "x", "name": ".."}), ".png") == "0007-x.png"
    assert output_name(PromptLine(7, {"prompt": "Hello, World!"}), ".mp4") == "0007-hello-world.mp4"
    assert output_name(PromptLine(7, {"prompt": "x", "name": "shot.PNG"}), ".png") == "shot.png"


def test_output_names_keep_whole_prompt_words():
    square = PromptLine(2, {"prompt": "A big orange square on a white background, centred"})
    assert output_name(square, ".png") == "0002-a-big-orange-square-on-a-white.png"
    assert prompt_words("a big orange square on a white backgroun") == "a-big-orange-square-on-a-white-backgroun"
    assert prompt_words("a big orange square on a white background") == "a-big-orange-square-on-a-white"
    assert prompt_words("one two three", limit=7) == "one-two"  # the word that ends exactly at the limit stays
    assert prompt_words("supercalifragilistic expialidocious", limit=10) == "supercalif"  # one long word: cut
    assert prompt_words("Hi, there! general", limit=9) == "hi-there"


def batch(*args: str, prompts: Path, out: Path, launch: bool = True) -> subprocess.Popen:
    command = ["launch", "--nproc", "2"] if launch else []
    return subprocess.Popen(
        [sys.executable, "-m", "app", *command, "batch", str(prompts), "--out", str(out), "--size", "64x64", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def manifest_files(out: Path) -> list[str]:
    path = out / "manifest.jsonl"
    return [json.loads(line)["file"] for line in path.read_text().splitlines()] if path.exists() else []


def test_batch_on_two_ranks_interrupted_and_resumed_writes_each_file_once(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "out"

    # 1. Interrupted (Ctrl-C) once the first file is in the manifest.
    first = batch("--steps", "40", prompts=prompts, out=out)
    deadline = time.monotonic() + 180
    while not manifest_files(out) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    done_before = manifest_files(out)
    assert 1 <= len(done_before) < 5, stderr
    assert "interrupted: run the same command again to resume" in stderr
    assert "launch: stopping: each rank ends at its next step" in stderr  # what a Ctrl-C does, said at once

    # 2. Resumed: the rest is written, nothing twice; the malformed line 4 is reported, the others go on.
    second = batch("--steps", "40", prompts=prompts, out=out)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 1, stderr  # 1: a line was bad
    assert "prompts.jsonl:4: skipped: not valid JSON" in stderr
    assert f"{5 - len(done_before)} written, {len(done_before)} already done, 1 bad or failed (lines 4)" in stderr
    assert "batch: " in stderr and "item" in stderr  # the progress bar
    files = manifest_files(out)
    assert sorted(files) == sorted(EXPECTED_FILES)
    assert {p.name for p in out.iterdir()} == EXPECTED_FILES | {"manifest.jsonl"}
    assert not (tmp_path / "escape").exists()
    with Image.open(out / "0002-a-blue-square.png") as image:
        assert image.size == (64, 32)
    entries = {e["file"]: e for e in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert entries["red.png"]["settings"]["seed"] == 1 and entries["red.png"]["ranks"] == 2
    assert entries["escape-attempt.png"]["settings"]["steps"] == 3
    assert entries["yellow.png"]["settings"]["guidance"] == 2.0 and entries["yellow.png"]["line"] == 5
    assert entries["0006-purple.png"]["step_seconds"] > 0
    stages = entries["0006-purple.png"]["stages"]  # where the time went (the writer thread adds its write)
    assert len(stages["step_s"]) == entries["0006-purple.png"]["settings"]["steps"]
    assert min(stages["encode_s"], stages["decode_s"], stages["write_s"], *stages["step_s"]) > 0

    # 3. Again, as one plain process: everything is already done.
    third = batch("--steps", "40", prompts=prompts, out=out, launch=False)
    _, stderr = third.communicate(timeout=300)
    assert "0 written, 5 already done" in stderr
    assert sorted(manifest_files(out)) == sorted(EXPECTED_FILES)


def test_batch_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app", "batch", str(tmp_path / "none.txt"), "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: prompt file {tmp_path / 'none.txt'} does not exist"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    result = subprocess.run([sys.executable, "-m", "app", "batch", str(prompts), "--out", str(tmp_path),
                             "--steps", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "steps must be between 1" in result.stderr
    assert os.listdir(tmp_path) == ["p.txt"]


def test_an_entry_appended_after_a_torn_last_line_is_kept(tmp_path):
    """An interrupted run's torn last line (no newline) must not swallow the next run's first entry."""
    from app.commands.manifest import MANIFEST_NAME, Manifest

    (tmp_path / "a.png").write_bytes(b"a")
    (tmp_path / "b.png").write_bytes(b"b")
    (tmp_path / MANIFEST_NAME).write_text('{"file": "a.png", "settings": {"seed": 1}}\n{"file": "b.p')
    Manifest(tmp_path).append({"file": "b.png", "settings": {"seed": 2}})
    resumed = Manifest(tmp_path)
    assert [entry["file"] for entry in resumed.entries()] == ["a.png", "b.png"]
    assert resumed.is_done("b.png", {"seed": 2})

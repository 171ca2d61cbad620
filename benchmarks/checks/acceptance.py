"""The GPU acceptance run: the app's own commands, as a user types them, each checked for its output, its exit
and what it leaves behind.

    python -m benchmarks.checks.acceptance --part generate --out DIR [--gpus N] [--rows a,b] [--models DIR]
    python -m benchmarks.checks.acceptance --part serve --out DIR
    python -m benchmarks.checks.acceptance --part batch --out DIR
    python -m benchmarks.checks.acceptance --report DIR [DIR ...]      # the markdown table of docs/app-on-gpus.md

Parts fit one 10-minute command each on 2 GPUs (benchmarks/multi_gpu.sh PART=accept-generate, accept-serve,
accept-batch), sharing one engine cache (--cache DIR, default /tmp/acceptance-engines) and one folder of
random-weight checkpoints (--models DIR, default /tmp/acceptance-models), so that a part run after another
starts warm. Every row is one command (or one server's session) run in its own process session:

- generate: the embedded models (tiny-flux, tiny-cosmos) on 1 GPU and on N, then on N with each lever (--cache,
  --fp8, --lora, --tp, --cfg-parallel, copy-engine transport, several at once); every other
  family's tiny random checkpoint (the records' bench.tiny_checkpoint); FLUX.1-dev's architecture with random
  weights, 1024², 28 steps, cold and warm (the warm one's launch-to-image time is the first-image figure), with
  --fp8 --cache, --tp N and a random LoRA; Wan 2.1 1.3B's with random weights (a video), plain, with --fp8 --cache
  and a random LoRA, and its --tp N refused with its reason; the bench command (on GPUs the real architecture);
  two `launch --nnodes 2` on one host, one GPU each. Where N ranks compute what one does, the row compares the
  pixels with the 1-GPU row (mean and largest difference, of 255 levels).
- serve: `launch serve` (tiny-flux and tiny-cosmos) through gradio_client (status, an image twice, a video)
  and `launch serve --no-ui` through the official openai client (images.generate, images.edit on a FLUX.2
  Klein checkpoint, videos create / poll / content / delete); Ctrl-C ends each; then a server whose rank 1 is
  killed (SIGKILL) during a request: the client hears why and the job ends within the rank timeout.
- batch: `launch batch` with --replicas auto; Ctrl-C after its first image, then the same command resumes (no
  image made twice, every line written); `build` into an empty cache and a generate on it.

Each row records: pass or fail with its reasons; seconds from launch to its result; seconds from its last line
of output to its exit (at most EXIT_SECONDS); processes it started still alive; temporary folders it left
(ulysses-studio-*, torchelastic_*, gradio uploads); GPU memory still in use after it (against before it).
DIR/rows.jsonl gets one line per row as it ends (a part cut short keeps its rows), DIR/logs/ each command's
output, time-stamped. Exits 1 if a row failed.

On a 4-GPU host two parts (or two sets of --rows) run side by side, each on two GPUs with a temporary folder and an
engine cache of its own (the leftover checks look at the temporary folder and at the part's GPUs only):

    CUDA_VISIBLE_DEVICES=0,1 TMPDIR=/tmp/a python -m benchmarks.checks.acceptance --part generate --rows ... \
        --out /tmp/acc/a --cache /tmp/acc/a-engines &
    CUDA_VISIBLE_DEVICES=2,3 TMPDIR=/tmp/b python -m benchmarks.checks.acceptance --part batch --out /tmp/acc/b ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

EXIT_SECONDS = 3.0
"""A command must end within this many seconds of its last line of output."""
GPU_MEMORY_SLACK_MIB = 64
"""GPU memory a row may leave in use (the driver's own bookkeeping moves by a few MiB)."""
LEFTOVER_PATTERNS = ("ulysses-studio", "torchelastic_", "gradio")
"""Temporary folders and files a command of the app makes (its own, torchrun's, Gradio's)."""
TEMP = Path(tempfile.gettempdir())

FLUX_IMAGE = ["--prompt", "a big red star in the center on a white background", "--seed", "7", "--steps", "8",
              "--size", "256x256"]
COSMOS_VIDEO = ["--prompt", "a red circle moving right on a black background", "--seed", "3", "--steps", "8",
                "--frames", "17", "--size", "128x128"]
LORA = "gray=assets/tiny-flux-lora-gray/pytorch_lora_weights.safetensors"
PARALLEL_TOLERANCE = 3.0
"""Mean difference (of 255 levels) allowed between N ranks' output and one rank's: bfloat16 arithmetic in another
order; a plan that mixes up tokens is off by tens."""
APPROXIMATE_TOLERANCE = 12.0
"""Mean difference allowed between an approximate lever's output (FP8) on N ranks and the exact one on one rank."""


@dataclass
class Row:
    """One checked command (or server session) and what it saw."""

    part: str
    name: str
    command: str = ""
    passed: bool = True
    problems: list[str] = field(default_factory=list)
    result_s: float | None = None
    """Seconds from its launch to its result (a file written, a server answering, a response)."""
    exit_s: float | None = None
    """Seconds from its last line of output to its exit."""
    status: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.passed = False
            self.problems.append(problem)
        return ok


class Command:
    """A process in a session of its own; its output, each line with the seconds since its start, in `log`."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.seen: dict[int, str] = {}
        """Every process it started that was seen running (pid -> command line): torchrun runs in a session of its
        own and starts each rank in another, so what a command leaves running is found by its process tree,
        looked at while it runs."""
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, env=env, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self.log.open("w") as stream:
            for line in self.process.stdout:
                # a progress bar's updates share a line: its last state is enough
                line = line.rstrip("\n").rpartition("\r")[2]
                at = time.monotonic() - self.started
                self.lines.append((at, line))
                stream.write(f"{at:7.2f} {line}\n")
                stream.flush()

    def track(self) -> dict[int, str]:
        """Record the processes it runs now (its process tree) into `seen`; returns them."""
        parents: dict[int, list[int]] = {}
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                parents.setdefault(parent, []).append(int(proc.name))
        now, todo = {}, [self.process.pid]
        while todo:
            pid = todo.pop()
            for child in parents.get(pid, []):
                line = _cmdline(child)
                if line is not None:
                    now[child] = line
                    todo.append(child)
        self.seen.update(now)
        return now

    def wait_for(self, pattern: str, timeout: float) -> float | None:
        """Seconds from the start to the first line matching `pattern`; None if none came (or the process ended)."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                at, line = self.lines[seen]
                seen += 1
                if compiled.search(line):
                    return at
            if self.process.poll() is not None and not self._reader.is_alive() and seen >= len(self.lines):
                return None
            self.track()
            time.sleep(0.05)
        return None

    def not_seen(self, what: str, timeout: float) -> str:
        """Why wait_for returned None: `what` within `timeout` s, or the command's end before it (its status and last
        line: a server that could not listen ends at once, and waiting its whole time would hide that)."""
        status = self.process.poll()
        if status is None:
            return f"{what} within {timeout:.0f} s"
        return f"{what}: it ended first, exit status {status}: {self.lines[-1][1] if self.lines else '(no output)'}"

    def finish(self, timeout: float) -> tuple[int | None, float | None]:
        """Wait for the end (at most `timeout` s, then SIGKILL to its session): (exit status or None if it had to
        be killed, seconds from its last line to its exit)."""
        self.track()
        try:
            status: int | None = self.process.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            status = None
        ended = time.monotonic() - self.started
        self._reader.join(5)
        last = self.lines[-1][0] if self.lines else 0.0
        return status, max(0.0, ended - last)

    def interrupt(self) -> None:
        """Ctrl-C, as a terminal sends it (to the launcher; it passes it on)."""
        self.process.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL to everything it started that still runs, and to its session."""
        for pid in self.left_alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def left_alive(self) -> list[int]:
        """The processes it started that are still running (the same pid with the same command line)."""
        return [pid for pid, line in self.seen.items() if _cmdline(pid) == line]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _cmdline(pid: int) -> str | None:
    """Process `pid`'s command line, None once it has ended (a zombie has an empty one)."""
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return line or None


def gpu_memory_mib() -> list[int]:
    """Memory in use on each visible GPU (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES: two parts may run side by
    side on one host, each on its own GPUs), [] without one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              *([f"--id={visible}"] if visible else [])],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(value) for value in out.split()]


def temp_entries() -> set[str]:
    return {entry.name for entry in TEMP.iterdir() if entry.name.startswith(LEFTOVER_PATTERNS)}


def _of_a_living_process(name: str) -> bool:
    """Whether a temporary folder's name (the app's: PREFIX-<pid>-XXXX) names a process still running: another
    program's on this machine, since a row checks only once everything of its own has ended."""
    match = re.search(r"-(\d+)-", name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pixels(path: Path) -> np.ndarray:
    """An image's pixels, or a video's frames, as int16 (H, W, 3) / (T, H, W, 3)."""
    if path.suffix == ".mp4":
        import imageio.v3 as iio

        return np.stack(list(iio.imiter(path))).astype(np.int16)
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def compare(row: Row, path: Path, reference: Path | None, tolerance: float) -> None:
    """Check `path` against `reference` (one rank's output): same shape, mean difference within `tolerance`."""
    if reference is None or not reference.exists() or not path.exists():
        return
    ours, theirs = pixels(path), pixels(reference)
    if not row.check(ours.shape == theirs.shape, f"shape {ours.shape} against one GPU's {theirs.shape}"):
        return
    difference = np.abs(ours - theirs)
    row.figures["vs_1_gpu_mean"] = round(float(difference.mean()), 3)
    row.figures["vs_1_gpu_max"] = int(difference.max())
    row.check(difference.mean() <= tolerance,
              f"{difference.mean():.2f} levels from one GPU's output on average (at most {tolerance})")


def check_media(row: Row, path: Path, frames: int | None = None) -> None:
    """The file exists, decodes, is not one flat colour (NaNs decode to black), and has the asked frames."""
    if not row.check(path.exists() and path.stat().st_size > 0, f"{path.name} was not written"):
        return
    try:
        data = pixels(path)
    except Exception as error:  # a file that does not decode is the failure itself
        row.check(False, f"{path.name} does not decode: {error}")
        return
    row.figures["shape"] = list(data.shape)
    row.check(float(data.std()) > 1.0, f"{path.name} is one flat colour")
    if frames is not None:
        row.check(data.shape[0] == frames, f"{data.shape[0]} frames, asked {frames}")


class Run:
    """One part's rows: their environment, their logs and their records."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.files = self.out / "files"
        for folder in (self.logs, self.files):
            folder.mkdir(parents=True, exist_ok=True)
        self.gpus = args.gpus
        self.cache = args.cache
        self.models = args.models
        self.rows: list[Row] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "ULYSSES_STUDIO_MODELS": str(self.models)}

    def wanted(self, name: str) -> bool:
        return not self.args.rows or name in self.args.rows

    def app(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "app", *args]

    def launch(self, nproc: int, *args: str) -> list[str]:
        return self.app("launch", "--nproc", str(nproc), *args)

    def start(self, row: Row, argv: list[str]) -> Command:
        row.command = " ".join(argv[2:] if argv[:2] == [sys.executable, "-m"] else argv)
        return Command(argv, self.logs / f"{row.name}.log", env=self.env)

    def settle(self, row: Row, command: Command, before_temp: set[str], before_gpu: list[int]) -> None:
        """What a command left behind once it ended: processes, temporary folders, GPU memory."""
        alive = [command.seen[pid][:160] for pid in command.left_alive()]
        if alive:
            command.kill()
        row.check(not alive, f"processes left running: {alive[:3]}")
        left = sorted(name for name in temp_entries() - before_temp if not _of_a_living_process(name))
        row.check(not left, f"temporary files left: {left[:5]}")
        if before_gpu:
            deadline = time.monotonic() + 3
            after = gpu_memory_mib()
            while time.monotonic() < deadline and any(a > b + GPU_MEMORY_SLACK_MIB for a, b in zip(after, before_gpu)):
                time.sleep(0.25)
                after = gpu_memory_mib()
            row.figures["gpu_mib_after"] = after
            row.check(all(a <= b + GPU_MEMORY_SLACK_MIB for a, b in zip(after, before_gpu)),
                      f"GPU memory still in use after the exit: {after} MiB against {before_gpu} before")

    def one_shot(self, name: str, argv: list[str], *, result: str | None, timeout: float,
                 expect_status: int = 0, check: Callable[[Row, Command], None] | None = None) -> Row | None:
        """Run a command to its end: its status, its result line (`result`, a pattern: its time is result_s), its exit
        within EXIT_SECONDS of its last output, nothing left behind; then `check`."""
        if not self.wanted(name):
            return None
        row = Row(part=self.args.part, name=name)
        before_temp, before_gpu = temp_entries(), gpu_memory_mib()
        command = self.start(row, argv)
        try:
            if result is not None:
                row.result_s = command.wait_for(result, timeout)
                row.check(row.result_s is not None, command.not_seen(f"no line matching {result!r}", timeout))
            status, row.exit_s = command.finish(timeout - (time.monotonic() - command.started))
            row.status = status
            row.check(status == expect_status, f"exit status {status}, expected {expect_status}: "
                      + " | ".join(line for _, line in command.lines[-3:]))
            row.check(row.exit_s <= EXIT_SECONDS, f"ended {row.exit_s:.1f} s after its last output")
            if check is not None:
                check(row, command)
        except Exception as error:  # one row's failure is recorded, the next row runs
            row.check(False, f"{type(error).__name__}: {error}")
        finally:
            if command.process.poll() is None:
                command.kill()
            self.settle(row, command, before_temp, before_gpu)
        return self.record(row)

    def record(self, row: Row) -> Row:
        self.rows.append(row)
        with (self.out / "rows.jsonl").open("a") as stream:
            stream.write(json.dumps(row.__dict__, default=str) + "\n")
        mark = "pass" if row.passed else "FAIL"
        exit_s = "-" if row.exit_s is None else f"{row.exit_s:.1f}"
        result_s = "-" if row.result_s is None else f"{row.result_s:.1f}"
        print(f"{mark} {row.part}/{row.name}: result {result_s} s, exit {exit_s} s after its output"
              + (f" · {row.figures}" if row.figures else "") + ("" if row.passed else f" · {row.problems}"),
              flush=True)
        return row

    def generate(self, name: str, nproc: int, model_args: list[str], out: Path, *, timeout: float = 240,
                 reference: Path | None = None, tolerance: float = PARALLEL_TOLERANCE,
                 frames: int | None = None) -> Row | None:
        """`launch --nproc N generate ...`: its file checked (and compared with `reference`)."""
        def check(row: Row, command: Command) -> None:
            check_media(row, out, frames)
            compare(row, out, reference, tolerance)
            ready = re.search(r"ready in ([\d.]+) s: (.*)", command.text())
            if ready:
                row.figures["ready"] = ready.group(0)
            wrote = re.search(r"wrote .*?\(([\d.]+) s.*", command.text())
            if wrote:
                row.figures["request"] = wrote.group(0).partition("(")[2].rstrip(")")

        if not self.wanted(name):  # a row not asked for keeps its file: another row's reference
            return None
        out.unlink(missing_ok=True)
        return self.one_shot(name, self.launch(nproc, "generate", *model_args, "--out", str(out), "--engine-cache",
                                               str(self.cache)), result=r"^wrote ", timeout=timeout, check=check)


def part_generate(run: Run) -> None:
    """The rows in order of what they prove first (a part cut short by its command's time keeps the first): the exit
    with and without the step cache, the first image (tiny-flux, then FLUX.1-dev's size), the levers, the video model,
    the other families, a real video architecture."""
    n, files = run.gpus, run.files
    flux, cosmos = ["--model", "tiny-flux", *FLUX_IMAGE], ["--model", "tiny-cosmos", *COSMOS_VIDEO]
    one = {"flux": files / "flux-1.png", "flux-cache": files / "flux-cache-1.png",
           "flux-lora": files / "flux-lora-1.png", "cosmos": files / "cosmos-1.mp4",
           "cosmos-cache": files / "cosmos-cache-1.mp4"}
    run.generate("tiny-flux-1-gpu", 1, flux, one["flux"])
    run.generate(f"tiny-flux-{n}-gpus-cold", n, flux, files / "flux-n.png", reference=one["flux"])
    warm = run.generate(f"tiny-flux-{n}-gpus-warm", n, flux, files / "flux-n-warm.png", reference=one["flux"])
    if warm is not None and (files / "flux-n.png").exists() and (files / "flux-n-warm.png").exists():
        warm.check(np.array_equal(pixels(files / "flux-n.png"), pixels(files / "flux-n-warm.png")),
                   "a warm relaunch drew other pixels than the launch that compiled its engines")
    run.generate("tiny-flux-1-gpu-cache", 1, [*flux, "--cache", "fbcache"], one["flux-cache"])
    run.generate(f"tiny-flux-{n}-gpus-cache", n, [*flux, "--cache", "fbcache"], files / "flux-cache.png",
                 reference=one["flux-cache"])
    if run.wanted("flux-dev") or any(name.startswith("flux-dev-") for name in run.args.rows):
        folder = random_folder(run, "flux-dev")
        real = ["--model", "flux-dev", "--model-path", str(folder), "--prompt", "a big red circle", "--seed", "1",
                "--size", "1024x1024", "--steps", "28"]
        run.generate(f"flux-dev-{n}-gpus-cold", n, real, files / "flux-dev.png", timeout=420)
        run.generate(f"flux-dev-{n}-gpus-warm", n, real, files / "flux-dev-warm.png", timeout=240)
        run.generate(f"flux-dev-{n}-gpus-fp8-cache", n, [*real, "--fp8", "--cache", "fbcache"],
                     files / "flux-dev-fp8.png", timeout=420)
        run.generate(f"flux-dev-{n}-gpus-tp", n, [*real, "--tp", str(n)], files / "flux-dev-tp.png", timeout=420)
        if run.wanted(f"flux-dev-{n}-gpus-lora"):
            lora = random_lora(run, "flux-dev")
            run.generate(f"flux-dev-{n}-gpus-lora", n, [*real, "--lora", f"random={lora}"], files / "flux-dev-lora.png",
                         timeout=420)
    run.generate("tiny-flux-1-gpu-lora", 1, [*flux, "--lora", LORA], one["flux-lora"])
    levers = {"fp8-cache-lora": (["--fp8", "--cache", "fbcache", "--lora", LORA], one["flux-lora"],
                                 APPROXIMATE_TOLERANCE),
              "tp": (["--tp", str(n)], one["flux"], PARALLEL_TOLERANCE),
              "copy-engine": (["--strategy", "allgather", "--all-to-all", "copy-engine"], one["flux"],
                              PARALLEL_TOLERANCE),
              # with the step cache the engine is +blockgraph: copy-engine exchanges (the K/V gather, Ulysses'
              # all-to-alls) inside inductor's CUDA graph trees
              "copy-engine-cache": (["--strategy", "allgather", "--all-to-all", "copy-engine", "--cache", "fbcache"],
                                    one["flux-cache"], PARALLEL_TOLERANCE),
              "ulysses-copy-engine-cache": (["--all-to-all", "copy-engine", "--cache", "fbcache"], one["flux-cache"],
                                            PARALLEL_TOLERANCE),
              "lora": (["--lora", LORA], one["flux-lora"], PARALLEL_TOLERANCE),
              "fp8": (["--fp8"], one["flux"], APPROXIMATE_TOLERANCE)}
    for lever, (extra, reference, tolerance) in levers.items():
        run.generate(f"tiny-flux-{n}-gpus-{lever}", n, [*flux, *extra], files / f"flux-{lever}.png",
                     reference=reference, tolerance=tolerance)
    run.generate("tiny-cosmos-1-gpu", 1, cosmos, one["cosmos"], frames=17)
    run.generate(f"tiny-cosmos-{n}-gpus", n, cosmos, files / "cosmos-n.mp4", reference=one["cosmos"], frames=17)
    run.generate("tiny-cosmos-1-gpu-cache", 1, [*cosmos, "--cache", "fbcache"], one["cosmos-cache"], frames=17)
    for lever, (extra, reference, tolerance) in {
            "cache": (["--cache", "fbcache"], one["cosmos-cache"], PARALLEL_TOLERANCE),
            "cfg-parallel": (["--cfg-parallel"], one["cosmos"], PARALLEL_TOLERANCE),
            "fp8": (["--fp8"], one["cosmos"], APPROXIMATE_TOLERANCE),
            "tp": (["--tp", str(n)], one["cosmos"], PARALLEL_TOLERANCE)}.items():
        run.generate(f"tiny-cosmos-{n}-gpus-{lever}", n, [*cosmos, *extra], files / f"cosmos-{lever}.mp4",
                     reference=reference, tolerance=tolerance, frames=17)
    # every other family: its tiny random checkpoint, on N GPUs with the step cache
    for name, model, args in TINY_FAMILIES:
        if not run.wanted(f"{name}-{n}-gpus-cache"):
            continue
        folder = tiny_folder(run, model)
        suffix = ".mp4" if "--frames" in args else ".png"
        run.generate(f"{name}-{n}-gpus-cache", n, ["--model", model, "--model-path", str(folder), *args,
                                                   "--cache", "fbcache"], files / f"{name}{suffix}")
    wan = ["--model", "wan2.1-t2v-1.3b", "--prompt", "a red circle", "--frames", "33", "--size", "832x480",
           "--steps", "10"]
    for name, extra in {f"wan2.1-1.3b-{n}-gpus": [],
                        f"wan2.1-1.3b-{n}-gpus-fp8-cache": ["--fp8", "--cache", "fbcache"],
                        f"wan2.1-1.3b-{n}-gpus-lora": None}.items():
        if run.wanted(name):
            folder = random_folder(run, "wan2.1-t2v-1.3b")
            if extra is None:  # a random LoRA on every linear of its blocks
                extra = ["--lora", f"random={random_lora(run, 'wan2.1-t2v-1.3b')}"]
            run.generate(name, n, [*wan, "--model-path", str(folder), *extra], files / f"{name}.mp4", timeout=420,
                         frames=33)
    if run.wanted(f"wan2.1-1.3b-{n}-gpus-tp-refused"):  # Wan's q/k norm spans all heads (docs/models.md)
        folder = random_folder(run, "wan2.1-t2v-1.3b")
        run.one_shot(f"wan2.1-1.3b-{n}-gpus-tp-refused",
                     run.launch(n, "generate", *wan, "--model-path", str(folder), "--tp", str(n), "--out",
                                str(files / "wan-tp.mp4")),
                     result=r"tensor parallelism cannot split WanTransformer3DModel", timeout=120, expect_status=2)
    if run.wanted("bench"):  # the bench command as the README types it: on GPUs the real architecture, CUDA graphs
        on_gpus = bool(gpu_memory_mib())
        shape = ["--sizes", "1024x1024", "--backends", "eager,inductor-blocks+cudagraph"] if on_gpus else \
            ["--tiny", "--backends", "eager"]
        run.one_shot("bench", run.app("bench", "--ranks", str(n), "--out", str(run.out / "bench"), "--",
                                      "--model", "flux-dev", *shape), result=None, timeout=420)
    if run.wanted("tiny-flux-2-hosts"):
        two_hosts(run, flux, files / "flux-2-hosts.png", reference=one["flux"])


TINY_FAMILIES = [
    ("wan2.1", "wan2.1-t2v-1.3b", ["--frames", "5", "--size", "64x48", "--steps", "4", "--prompt", "a red circle"]),
    ("wan2.2-ti2v", "wan2.2-ti2v-5b", ["--frames", "9", "--size", "96x96", "--steps", "4", "--prompt", "a red circle"]),
    ("qwen-image", "qwen-image", ["--size", "64x48", "--steps", "4", "--prompt", "a big red circle"]),
    ("flux2-klein", "flux2-klein-4b", ["--size", "64x48", "--steps", "4", "--prompt", "a red circle"]),
    ("flux3-klein-base", "flux3-klein-base", ["--size", "64x48", "--steps", "4", "--prompt", "a big red circle"]),
    ("cosmos3-nano", "cosmos3-nano", ["--frames", "9", "--size", "96x64", "--steps", "4", "--prompt", "a red circle"]),
]
"""Every family without an embedded model: a name, the model whose tiny random checkpoint it runs, a request."""


def two_hosts(run: Run, model_args: list[str], out: Path, reference: Path) -> None:
    """`launch --nnodes 2` twice on this host, one GPU each (CUDA_VISIBLE_DEVICES), meeting at one rendezvous, as two
    hosts would: host 0 writes the image; both end within EXIT_SECONDS of their last output."""
    from app.commands.launch import free_port

    row = Row(part=run.args.part, name="tiny-flux-2-hosts")
    before_temp, before_gpu = temp_entries(), gpu_memory_mib()
    endpoint = f"127.0.0.1:{free_port()}"
    out.unlink(missing_ok=True)
    hosts, gpus = [], _visible_gpus()
    for node in range(2):
        argv = run.app("launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                       "generate", *model_args, "--out", str(out), "--engine-cache", str(run.cache))
        env = {**run.env, "CUDA_VISIBLE_DEVICES": gpus[node]} if gpus else run.env
        row.command = " ".join(argv[2:])
        hosts.append(Command(argv, run.logs / f"{row.name}-host{node}.log", env=env))
    try:
        row.result_s = hosts[0].wait_for(r"^wrote ", 300)
        row.check(row.result_s is not None, hosts[0].not_seen("host 0 wrote no image", 300))
        ends = []
        for node, host in enumerate(hosts):
            status, exit_s = host.finish(60)
            ends.append(host.started + (host.lines[-1][0] if host.lines else 0.0) + exit_s)
            row.check(status == 0, f"host {node} ended with status {status}")
        # a follower host prints little and then waits for the job: each host's end counts from the job's last output
        last_output = max(host.started + host.lines[-1][0] for host in hosts if host.lines)
        row.exit_s = max(end - last_output for end in ends)
        row.check(row.exit_s <= EXIT_SECONDS, f"a host ended {row.exit_s:.1f} s after the job's last output")
        check_media(row, out)
        compare(row, out, reference, PARALLEL_TOLERANCE)
    except Exception as error:  # one row's failure is recorded, the next row runs
        row.check(False, f"{type(error).__name__}: {error}")
    finally:
        for host in hosts:
            if host.process.poll() is None:
                host.kill()
        run.settle(row, _Both(hosts), before_temp, before_gpu)
    run.record(row)


class _Both:
    """Several commands, seen as one by Run.settle."""

    def __init__(self, commands: list[Command]) -> None:
        self.commands = commands
        self.seen = {pid: line for command in commands for pid, line in command.seen.items()}

    def left_alive(self) -> list[int]:
        return [pid for command in self.commands for pid in command.left_alive()]

    def kill(self) -> None:
        for command in self.commands:
            command.kill()


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (or by index); [] without one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return visible.split(",")
    return [str(index) for index in range(len(gpu_memory_mib()))]


def random_lora(run: Run, model: str) -> Path:
    """A random rank-16 LoRA of `model`'s transformer (benchmarks.step.write_random_lora), written once."""
    path = run.models / f"{model}-lora-16.safetensors"
    if not path.exists():
        from benchmarks.inputs import bench_model
        from benchmarks.step import write_random_lora

        write_random_lora(bench_model(model), 16, path)
    return path


def tiny_folder(run: Run, model: str) -> Path:
    """`model`'s tiny random checkpoint (its family record's bench.tiny_checkpoint), written once."""
    from pipelines.family import load
    from pipelines.registry import family_of, get_spec

    folder = run.models / f"tiny-{model}"
    if not folder.exists():
        spec = get_spec(model)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        load(family_of(spec).bench.tiny_checkpoint)(spec, partial)
        partial.rename(folder)
    return folder


def random_folder(run: Run, model: str) -> Path:
    """`model`'s published architecture with random weights, written once (benchmarks.replicas), by a process of its
    own: the weights are made on a GPU, and this process holds no GPU memory while it checks what the rows leave."""
    folder = run.models / model
    if not folder.exists():
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from benchmarks.replicas import write_random_checkpoint; "
                        "write_random_checkpoint(sys.argv[1], Path(sys.argv[2]))", model, str(folder)], check=True)
        print(f"wrote {model}'s random checkpoint in {time.monotonic() - started:.0f} s", flush=True)
    return folder


def part_batch(run: Run) -> None:
    n, files = run.gpus, run.files
    prompts = files / "prompts.txt"
    prompts.write_text("".join(f"a {colour} circle on a white background\n"
                               for colour in ("red", "blue", "green", "yellow", "purple", "orange", "black", "gray")))
    out = files / "batch"
    shutil.rmtree(out, ignore_errors=True)
    common = [str(prompts), "--model", "tiny-flux", "--size", "256x256", "--steps", "8", "--out", str(out),
              "--engine-cache", str(run.cache)]

    def manifest() -> list[dict]:
        path = out / "manifest.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    # Ctrl-C after the first image, then the same command again: it resumes
    if run.wanted("batch-interrupted"):
        row = Row(part="batch", name="batch-interrupted")
        before_temp, before_gpu = temp_entries(), gpu_memory_mib()
        command = run.start(row, run.launch(n, "batch", *common, "--replicas", "auto"))
        try:
            row.result_s = command.wait_for(r"\.png", 240)
            row.check(row.result_s is not None, command.not_seen("no image", 240))
            command.interrupt()
            interrupted = time.monotonic()
            row.status, row.exit_s = command.finish(60)
            row.figures["ctrl_c_to_exit_s"] = round(time.monotonic() - interrupted, 2)
            row.check(row.status == 130, f"exit status {row.status} after Ctrl-C, expected 130")
            row.check(row.exit_s <= EXIT_SECONDS, f"ended {row.exit_s:.1f} s after its last output")
            row.check("Traceback" not in command.text(), "a traceback after Ctrl-C")
            row.figures["written_before_ctrl_c"] = len(manifest())
        finally:
            if command.process.poll() is None:
                command.kill()
            run.settle(row, command, before_temp, before_gpu)
        run.record(row)
        done = {entry["file"] for entry in manifest()}

        def resumed(row: Row, command: Command) -> None:
            entries = manifest()
            files_made = [entry["file"] for entry in entries]
            row.figures["lines"] = len(entries)
            row.check(len(files_made) == len(set(files_made)) == 8, f"manifest has {len(entries)} lines for 8 prompts")
            row.check(f"{len(done)} already done" in command.text(), f"it did not skip the {len(done)} done")
            row.figures["groups"] = sorted({entry.get("group", "") for entry in entries})
            for entry in entries:
                check_media(row, out / entry["file"])

        run.one_shot("batch-resumed", run.launch(n, "batch", *common, "--replicas", "auto"), result=r"^batch: ",
                     timeout=300, check=resumed)

    # build ahead into an empty cache, then generate from it without compiling
    built = files / "built-engines"
    shutil.rmtree(built, ignore_errors=True)
    run.one_shot("build", run.app("build", "--model", "tiny-flux", "--size", "256x256", "--ranks", str(n),
                                  "--engine-cache", str(built)), result=None, timeout=300)

    def from_build(row: Row, command: Command) -> None:
        check_media(row, files / "built.png")
        first = re.search(r"(\d+) steps? ([\d.]+) s", command.text())
        if first:
            row.figures["steps_s"] = float(first.group(2))

    run.one_shot("generate-on-built-cache", run.launch(n, "generate", "--model", "tiny-flux", *FLUX_IMAGE, "--out",
                                                       str(files / "built.png"), "--engine-cache", str(built)),
                 result=r"^wrote ", timeout=240, check=from_build)


def part_serve(run: Run) -> None:
    n, files = run.gpus, run.files
    from app.commands.launch import free_port

    def server(row: Row, *args: str) -> tuple[Command, str]:
        port = free_port()
        command = run.start(row, run.launch(n, "serve", "--port", str(port), "--engine-cache", str(run.cache), *args))
        return command, f"http://127.0.0.1:{port}"

    def session(name: str, args: list[str], body: Callable[[Row, Command, str], None], *, up: str = r"^serving on",
                expect_status: int = 130, stop: bool = True) -> None:
        if not run.wanted(name):
            return
        row = Row(part="serve", name=name)
        before_temp, before_gpu = temp_entries(), gpu_memory_mib()
        command, url = server(row, *args)
        try:
            row.result_s = command.wait_for(up, 300)
            if row.check(row.result_s is not None, command.not_seen("the server did not come up", 300)):
                ready = re.search(r"ready in .*", command.text())
                if ready:
                    row.figures["ready"] = ready.group(0)
                try:
                    body(row, command, url)
                except Exception as error:  # recorded; the server is still stopped and timed below
                    row.check(False, f"{type(error).__name__}: {error}")
            if stop:
                command.interrupt()
            stopped = time.monotonic()
            row.status, row.exit_s = command.finish(60)
            row.figures["stop_s"] = round(time.monotonic() - stopped, 2)
            row.check(row.status == expect_status, f"exit status {row.status}, expected {expect_status}")
            row.check(row.exit_s <= EXIT_SECONDS, f"ended {row.exit_s:.1f} s after its last output")
        except Exception as error:  # recorded; the next server runs
            row.check(False, f"{type(error).__name__}: {error}")
        finally:
            if command.process.poll() is None:
                command.kill()
            run.settle(row, command, before_temp, before_gpu)
        run.record(row)

    def through_gradio(row: Row, command: Command, url: str) -> None:
        from gradio_client import Client

        # the client downloads results into a folder of this run's: by default it is $TMPDIR/gradio, which would
        # count against the server as a temporary folder left behind; and it leaves an empty $TMPDIR/<40 hex digits>
        # folder per download (gradio_client 2.7's Client._download_file), so this process's temporary folder is
        # the run's too (the commands it starts keep TEMP)
        (files / "client-temp").mkdir(exist_ok=True)
        tempfile.tempdir = str(files / "client-temp")
        client = Client(url + "/", verbose=False, download_files=str(files / "gradio-client"))
        image = ("a big red star in the center on a white background", 7, False, 8, 3.5, 256, 256)
        started = time.monotonic()
        _, first, _, _, _ = client.predict(*image, api_name="/generate_image")
        row.figures["first_image_s"] = round(time.monotonic() - started, 2)
        started = time.monotonic()
        _, second, _, _, _ = client.predict(*image, api_name="/generate_image")
        row.figures["repeat_image_s"] = round(time.monotonic() - started, 3)
        row.check(np.array_equal(pixels(Path(first)), pixels(Path(second))), "the same request drew other pixels")
        shutil.copy(first, files / "served.png")
        video = ("a red circle moving right on a black background", "", None, 17, 8, 3, False, 8, 3.0, 128, 128)
        _, mp4, _, _, _ = client.predict(*video, api_name="/generate_video")
        check_media(row, Path(mp4), 17)
        row.figures["status"] = str(client.predict(api_name="/status"))[:200]

    session("serve-ui-gradio-client", [], through_gradio)

    klein = tiny_folder(run, "flux2-klein-4b")

    def through_openai(row: Row, command: Command, url: str) -> None:
        import base64
        import urllib.request

        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        health = urllib.request.urlopen(url + "/health", timeout=10)
        row.check(health.status == 200, f"/health answered {health.status}")
        page = None
        try:
            page = urllib.request.urlopen(url + "/", timeout=10).status
        except urllib.error.HTTPError as error:
            page = error.code
        row.check(page == 404, f"/ answered {page}: a page where --no-ui serves none")
        image = client.images.generate(prompt="a red circle", size="64x64", extra_body={"seed": 3, "steps": 4})
        generated = files / "api.png"
        generated.write_bytes(base64.b64decode(image.data[0].b64_json))
        check_media(row, generated)
        with generated.open("rb") as reference:
            edited = client.images.edit(image=reference, prompt="a blue circle", size="64x64",
                                        extra_body={"seed": 3, "steps": 4})
        edit = files / "api-edit.png"
        edit.write_bytes(base64.b64decode(edited.data[0].b64_json))
        check_media(row, edit)
        video = client.videos.create_and_poll(prompt="a red square moving right on a white background",
                                              extra_body={"frames": 17, "steps": 8, "seed": 3})
        row.check(video.status == "completed", f"video job {video.status}: {getattr(video, 'error', None)}")
        mp4 = files / "api.mp4"
        client.videos.download_content(video.id).write_to_file(mp4)
        check_media(row, mp4, 17)
        deleted = client.videos.delete(video.id)
        row.check(bool(deleted.deleted), "the video was not deleted")

    session("serve-no-ui-openai", ["--no-ui", "--model", "flux2-klein-4b", "--model-path", str(klein),
                                   "--video-model", "tiny-cosmos"], through_openai)

    def kill_a_rank(row: Row, command: Command, url: str) -> None:
        import urllib.request

        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                answer["video"] = client.videos.create_and_poll(
                    prompt="a red square moving right on a white background",
                    extra_body={"frames": 63, "steps": 500, "seed": 3})
            except Exception as error:  # the error is what the client should get
                answer["error"] = str(error)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the request is past its first step (GET /status)
            running = json.loads(urllib.request.urlopen(url + "/status", timeout=10).read()).get("running", [])
            if running and (running[0].get("step") or 0) >= 1:
                break
            time.sleep(0.1)
        pids = [pid for pid in command.track() if _is_rank(pid, 1)]
        if not row.check(bool(pids), "rank 1 not found"):
            return
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        status, _ = command.finish(90)
        row.figures["kill_to_exit_s"] = round(time.monotonic() - killed, 2)
        asking.join(30)
        video = answer.get("video")
        said = answer.get("error") or (str(getattr(video, "error", "")) if video is not None else "")
        row.figures["client_heard"] = said[:200]
        row.check("rank" in said, f"the client was not told a rank was lost: {said[:200]!r}")
        row.check(any("rank 1 is gone" in line for _, line in command.lines), "the server did not name rank 1")

    session("serve-rank-killed", ["--no-ui", "--model", "tiny-cosmos"], kill_a_rank, expect_status=1, stop=False)


def _is_rank(pid: int, rank: int) -> bool:
    """Whether process `pid` is rank `rank` of a run (torchrun's ranks carry RANK; its agent does not)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"RANK={rank}".encode() in environ and b"app" in command and b"app.commands.torchrun" not in command


def environment() -> dict[str, Any]:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("diffusers", "transformers", "gradio", "torchao", "openai", "imageio_ffmpeg"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # not installed here
            versions[name] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"date": time.strftime("%Y-%m-%d"), "gpus": gpus, "cpus": os.cpu_count(), "versions": versions}


def report(folders: list[Path]) -> str:
    """The markdown table of the rows in `folders` (their rows.jsonl and environment.json)."""
    lines = []
    for folder in folders:
        env = json.loads((folder / "environment.json").read_text())
        gpus = env["gpus"]
        hardware = f"{len(gpus)}x {gpus[0].removeprefix('NVIDIA ')}" if gpus else f"{env['cpus']} CPU cores"
        versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
        lines += [f"{hardware}, {env['date']}: {versions}", "",
                  "| row | command | result | exit after output | checks |", "| --- | --- | --- | --- | --- |"]
        for raw in (folder / "rows.jsonl").read_text().splitlines():
            row = json.loads(raw)
            figures = row["figures"]
            shown = {k: figures[k] for k in ("vs_1_gpu_mean", "vs_1_gpu_max", "first_image_s", "kill_to_exit_s",
                                             "stop_s", "ctrl_c_to_exit_s") if k in figures}
            result = "-" if row["result_s"] is None else f"{row['result_s']:.1f} s"
            exit_s = "-" if row["exit_s"] is None else f"{row['exit_s']:.1f} s"
            verdict = "pass" if row["passed"] else "FAIL: " + "; ".join(row["problems"])
            extra = ", ".join(f"{k} {v}" for k, v in shown.items())
            lines.append(f"| {row['part']}/{row['name']} | `{_short(row['command'])}` | {result} | {exit_s} | "
                         f"{verdict}{' (' + extra + ')' if extra else ''} |")
        lines.append("")
    return "\n".join(lines)


def _short(command: str) -> str:
    """A row's command without what every row of its kind repeats: the prompt's words, the output and cache paths,
    a checkpoint folder's parent."""
    words, kept, skip = command.split(), [], False
    for word in words:
        if word.startswith("--"):
            skip = word in ("--prompt", "--out", "--engine-cache", "--seed")
            if not skip:
                kept.append(word)
        elif not skip:
            kept.append(Path(word).name if word.startswith("/") else word)
    return " ".join(kept).removeprefix("app ")


PARTS = {"generate": part_generate, "batch": part_batch, "serve": part_serve}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=sorted(PARTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gpus", type=int, default=None, help="ranks of the multi-rank rows (default: visible GPUs)")
    parser.add_argument("--rows", type=lambda text: set(text.split(",")), default=set(),
                        help="only these rows (names as printed)")
    parser.add_argument("--cache", type=Path, default=TEMP / "acceptance-engines")
    parser.add_argument("--models", type=Path, default=TEMP / "acceptance-models")
    parser.add_argument("--report", type=Path, nargs="+", help="print the table of these result folders")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.part is None or args.out is None:
        parser.error("--part and --out, or --report")
    # A SIGTERM (`timeout`) unwinds like Ctrl-C, so that the command in flight is killed by its row's `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.gpus is None:
        from app.commands.launch import default_nproc

        args.gpus = default_nproc()
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    (args.out / "environment.json").write_text(json.dumps(environment(), indent=1))
    run = Run(args)
    PARTS[args.part](run)
    failed = [row.name for row in run.rows if not row.passed]
    print(f"{len(run.rows) - len(failed)} of {len(run.rows)} rows passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

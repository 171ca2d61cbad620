"""`ulysses-studio batch PROMPTS --out DIR`: every prompt of a file, on one rank or many, resumable.

Rank 0 reads and validates the file line by line (a bad line is reported with its number; the rest
go on), skips what the manifest says is already done, and queues the rest; each group of ranks (one, or
--replicas of them, app.ranks.groups) takes the next line as it frees up, with a progress bar. Each file is written
under a temporary name and renamed when complete, then listed in DIR/manifest.jsonl with the seconds of each stage
(encode, every step, decode, write). Files are written by a writer thread while the ranks generate the next line (an MP4
takes seconds to encode); the run waits for the last writes before it ends, interrupted or not. Exit status: 0 when
every line is done, 1 when some line was bad or failed (the others are still written), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.commands.arguments import (
    add_model_arguments,
    add_parallel_arguments,
    add_replicas_argument,
    add_request_arguments,
    lora_limits,
    request_fields,
    run_options,
)
from app.commands.prompt_files import FIELDS, SUFFIXES, BadLine, BatchError, output_name, read_prompt_file
from app.commands.prompt_files import request_fields as line_fields
from app.outputs import EXTENSIONS, check_results_folder, check_writer, settings_of
from app.ranks.stopping import stop_on_signals
from pipelines.registry import ModelSpec, resolve_model
from pipelines.requests import GenerationRequest, MediaLimits, RequestError, make_request, read_limits

__all__ = ["BatchError", "add_batch_arguments", "check_batch", "run_batch"]

WRITES_AHEAD = 2
"""Results waiting for the writer thread at most: the next generation waits rather than pile up frames."""


@dataclass(frozen=True)
class BatchPlan:
    """A checked batch command line."""

    spec: ModelSpec
    folder: Path
    limits: MediaLimits
    prompts: Path
    out_dir: Path
    defaults: dict[str, Any]
    """make_request fields from the command line, under each line's own values."""


@dataclass(frozen=True)
class Task:
    """One line that will be generated."""

    line: int
    file: str
    request: GenerationRequest


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", metavar="PROMPTS",
                        help=f"prompt file: {', '.join(SUFFIXES)}. A .txt holds one prompt a line; each .jsonl "
                             f"object or .csv column may set {', '.join(FIELDS)} (prompt is required; size is "
                             "WxH; input is a conditioning image or video (a reference image for FLUX.2), relative "
                             "to the prompt file; name is the output file's name; lora is the --lora names it uses "
                             "with their scales, e.g. style:0.8,detail). "
                             "The command line's settings apply where a line sets none")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created if missing)")
    add_model_arguments(parser)
    add_request_arguments(parser, prompt_required=False)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_replicas_argument(parser)
    add_parallel_arguments(parser)


def check_batch(args: argparse.Namespace) -> BatchPlan:
    """Check the model, the prompt file, the output folder and the default settings; load nothing."""
    spec, folder = resolve_model(args.model, args.model_path)
    limits = lora_limits(args, spec, folder, read_limits(spec, folder, cfg_parallel=args.cfg_parallel))
    prompts = Path(args.prompts).expanduser()
    if not prompts.is_file():
        raise BatchError(f"prompt file {prompts} does not exist")
    if prompts.suffix.lower() not in SUFFIXES:
        raise BatchError(f"{prompts}: prompt files are {', '.join(SUFFIXES)}")
    out_dir = check_results_folder(args.out)
    check_writer(spec)
    defaults = {key: value for key, value in request_fields(args).items() if value is not None}
    make_request(spec, limits, prompt="a check of the command line's settings", **defaults)
    return BatchPlan(spec=spec, folder=folder, limits=limits, prompts=prompts, out_dir=out_dir, defaults=defaults)


def run_batch(args: argparse.Namespace) -> int:
    """Generate every line of the prompt file not yet done (rank 0 drives; other ranks follow)."""
    plan = check_batch(args)

    from app.ranks.runtime import start_runtime

    with stop_on_signals() as stop, start_runtime([(plan.spec, plan.folder)], run_options(args), stop=stop,
                                                  replicas=args.replicas) as runtime:
        if not runtime.is_main:
            runtime.follow()
            return 0
        return _run_lines(plan, runtime, stop, quiet=args.quiet)


def plan_tasks(plan: BatchPlan, manifest) -> tuple[list[Task], int, list[BadLine]]:
    """The lines still to generate, the number already done, and the bad lines (with their reasons)."""
    extension = EXTENSIONS[plan.spec.media]
    tasks, done, bad = [], 0, []
    used: dict[str, int] = {}
    for item in read_prompt_file(plan.prompts):
        if isinstance(item, BadLine):
            bad.append(item)
            continue
        file = output_name(item, extension)
        if file in used:
            bad.append(BadLine(item.line, f"output name {file} is already used by line {used[file]}"))
            continue
        used[file] = item.line
        try:
            request = make_request(plan.spec, plan.limits, **line_fields(item, plan.defaults, plan.prompts.parent))
        except RequestError as error:
            bad.append(BadLine(item.line, str(error)))
            continue
        if manifest.is_done(file, settings_of(request, plan.spec)):
            done += 1
            continue
        tasks.append(Task(line=item.line, file=file, request=request))
    return tasks, done, bad


def _run_lines(plan: BatchPlan, runtime, stop, *, quiet: bool) -> int:
    import threading

    from tqdm import tqdm

    from app.commands.manifest import Manifest
    from app.server.jobs import Job, JobQueue, serve_jobs

    plan.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(plan.out_dir)
    tasks, done, bad = plan_tasks(plan, manifest)
    for item in bad:
        print(f"{plan.prompts}:{item.line}: skipped: {item.message}", file=sys.stderr)
    written, failed, interrupted = 0, [], False
    writes: list[tuple[Task, Future]] = []
    lock = threading.Lock()
    queue = JobQueue(max_waiting=max(1, len(tasks)))
    task_of = {id(queue.submit(plan.spec.media, task.request)): task for task in tasks}
    with tqdm(total=len(tasks), desc="batch", unit="item", disable=quiet, file=sys.stderr) as bar, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-writer") as writer:

        def ended(job: Job, outcome) -> None:  # in the thread of the group that ran it
            nonlocal interrupted
            task = task_of[id(job)]
            with lock:
                if isinstance(outcome, str):
                    if stop.is_set():
                        interrupted = True  # not done: the next run does it
                        return
                    tqdm.write(f"{plan.prompts}:{task.line}: failed: {outcome}", file=sys.stderr)
                    failed.append(task.line)
                    bar.update()
                    return
                pending = [future for _, future in writes if not future.done()]
            while len(pending) >= WRITES_AHEAD:  # the next generation waits rather than pile up frames
                pending[0].exception()
                pending = [future for future in pending if not future.done()]
            with lock:
                writes.append((task, writer.submit(_write_line, plan, manifest, task, outcome, job.ranks,
                                                   job.ran_on)))
                bar.set_postfix_str(task.file, refresh=False)
                bar.update()

        try:
            serve_jobs(runtime, queue, stop, None, until_drained=True, on_end=ended)
        finally:
            writer.shutdown(wait=True)  # every result generated is written, interrupted or not
    interrupted = interrupted or stop.is_set()
    for task, future in writes:
        error = future.exception()
        if error is None:
            written += 1
        else:
            print(f"{plan.prompts}:{task.line}: could not write {task.file}: {error}", file=sys.stderr)
            failed.append(task.line)
    problems = sorted([item.line for item in bad] + failed)
    print(f"batch: {written} written, {done} already done, {len(problems)} bad or failed"
          + (f" (lines {', '.join(map(str, problems))})" if problems else "")
          + (", interrupted: run the same command again to resume" if interrupted else "")
          + f"; manifest: {manifest.path}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if problems else 0


def _write_line(plan: BatchPlan, manifest, task: Task, generation, ranks: int, ran_on: dict[str, str] | None) -> None:
    """The writer thread's work for one line: the file under a temporary name, renamed, then its manifest entry
    (`ran_on`: the group and plan that made it, where the ranks form several groups)."""
    from app.outputs import write_result

    started = time.perf_counter()
    partial = plan.out_dir / f".partial-{task.file}"
    write_result(generation.result, partial, task.request, plan.spec, generation.computed_steps, ran_on)
    os.replace(partial, plan.out_dir / task.file)
    stages = generation.stages.with_write(time.perf_counter() - started) if generation.stages else None
    manifest.append({
        "line": task.line, "file": task.file, "prompts": str(plan.prompts),
        "settings": settings_of(task.request, plan.spec), "seconds": round(generation.seconds, 3),
        "step_seconds": round(generation.step_seconds, 4), "computed_steps": generation.computed_steps,
        "stages": stages.to_dict() if stages else None, "ranks": ranks, **(ran_on or {}),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })

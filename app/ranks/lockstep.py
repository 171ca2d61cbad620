"""The lockstep service: one request on rank 0 becomes the same call on every rank.

Rank 0 owns the requests (UI queue, batch file, command line); the other ranks `follow()`. All app
traffic goes over the context's CPU control group (gloo), one request at a time:

    rank 0:      broadcast Run(request); encode; broadcast the encoding (or the error it raised)
    every rank:  finish the encoding where the pipeline splits part of it (prepare: an input video's VAE encode)
    every rank:  denoise, with an agreement point after every step and one after the loop
    rank 0:      decode (every rank, when the pipeline splits the decode over them: pipelines.split_vae);
    every rank:  one last meeting (the decode's outcome, and proof that all ranks live)
    rank 0:      hand the result back to the caller, with the seconds of each stage (app.stage_times)

Requests are validated (pipelines.requests.make_request) before `run`, so nothing invalid reaches a
collective. An agreement point is one all_reduce of [stop wanted, failed, cancelled] with a time limit:
a rank whose step raised meets the others at their next agreement point, every rank drops the
request (JobFailed) and the service goes on. Rank 0 alone decides a cancellation (its caller's
`should_stop`: a client that cancelled or left, a request over the server's time limit): every rank
drops the request at the next agreement point (JobCancelled) and the service goes on, as it does
after a failure; a stop (Ctrl-C, SIGTERM) ends the service instead. A rank that cannot be reached
within `rank_timeout` seconds, or whose connection closes (it died), is RankLost: the run ends,
because a collective left half done cannot be taken back. While idle, rank 0 sends a heartbeat every HEARTBEAT_SECONDS
so that the followers' wait never hits the process group's timeout.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from app.failures import JobCancelled, JobFailed, RankLost, describe
from app.ranks.stopping import process_running
from app.stage_times import StageSeconds
from engines.parallel.distributed import ParallelContext
from pipelines.requests import GenerationRequest

STOPPED = "stopped (interrupt or SIGTERM)"
"""Why a request ends when the server is stopped (Ctrl-C, SIGTERM) while it runs."""
HEARTBEAT_SECONDS = 5.0
DEAD_RANK_WAIT_SECONDS = 0.3
"""How long a rank whose collective failed looks for the dead peer's process before giving up naming it."""

StepCallback = Callable[[int, int], None]
StopCheck = Callable[[int, int], "str | None"]
"""Rank 0's question at each agreement point, given (steps done, total): a reason to cancel, or None."""


@dataclass(frozen=True)
class Run:
    """Control message: run `request` on the model registered under `model`."""

    job: int
    model: str
    request: GenerationRequest


@dataclass(frozen=True)
class Heartbeat:
    """Control message: rank 0 is alive and idle."""


@dataclass(frozen=True)
class Stop:
    """Control message: the run is over (a follower leaves `follow()`; a group's leader, app.ranks.groups.lead, releases
    its group and ends)."""


@dataclass(frozen=True)
class HandOver:
    """Control message: the group's ranks leave this service, for rank 0 to group them another way (app.ranks.groups);
    the service stays usable."""


@dataclass(frozen=True)
class Regroup:
    """Control message on the service of all ranks: form the groups of layout `layout` (app.ranks.groups.Layout)."""

    layout: int


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What rank 0 gets back from `run`."""

    result: Any
    """PIL image, or uint8 frames [T, H, W, 3]."""
    model: str
    request: GenerationRequest
    seconds: float
    """Wall time of the whole request (encode, denoise, decode)."""
    step_seconds: float
    """Mean wall time of one denoising step, agreement included."""
    computed_steps: int | None = None
    """Steps whose transformer blocks all ran (the others reused the step cache's); None without --cache."""
    stages: StageSeconds | None = None
    """Seconds of encode, each step and decode (the file's write is its writer's to add)."""
    rank_memory: Mapping[int, tuple[str, int]] | None = None
    """Each rank of the group that ran it (global rank) -> (device, bytes): on a GPU the peak memory allocated during
    the request, on a CPU the process's resident memory at its end (rank_memory_bytes)."""


class _StepClock:
    """Each denoising step's seconds: on a GPU from CUDA events on the current stream (a step's device time,
    read once the loop is over, so no step waits for the device), elsewhere from the host clock."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks = [self._now()]

    def mark(self) -> None:
        self._marks.append(self._now())

    def seconds(self) -> tuple[float, ...]:
        pairs = list(zip(self._marks, self._marks[1:]))
        if not self._cuda:
            return tuple(end - begin for begin, end in pairs)
        if self._marks:
            self._marks[-1].synchronize()
        return tuple(begin.elapsed_time(end) / 1000 for begin, end in pairs)


def _short(error: BaseException) -> str:
    """describe(error) without gloo's source location and advice, which hide the one fact that matters."""
    text = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", describe(error))
    return text.split(". This is typically")[0]


def rank_memory_bytes(device: torch.device) -> tuple[str, int]:
    """This rank's memory after a request, as ("cuda", the peak bytes allocated on its GPU since the last call) or
    ("cpu", the process's resident bytes now: a CPU rank's tensors live there)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda", int(peak)
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux
        return "cpu", 0
    return "cpu", pages * os.sysconf("SC_PAGE_SIZE")


def _to_cpu(value: Any) -> Any:
    """A dataclass of tensors with every tensor moved to the CPU (what gloo pickles and ships)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to_cpu(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


class LockstepService:
    """Runs requests on every rank of `ctx` in the same order; see the module docstring.

    Args:
        pipelines: model key -> pipeline with encode/denoise/decode (ranks > 0 hold ones without encoders).
        stop: set by a signal (app.ranks.stopping); honoured at the next agreement point on every rank.
        rank_timeout: seconds a rank waits for the others at an agreement point before RankLost.
        heartbeat_seconds: how often an idle rank 0 tells the followers it is alive (well under the
            control group's timeout, 30 min by default).
        rank_processes: rank -> (host name, pid) of every rank (runtime gathers them at start-up), so
            that a RankLost can name the rank that died.
    """

    def __init__(
        self,
        ctx: ParallelContext,
        pipelines: Mapping[str, Any],
        *,
        stop: threading.Event,
        rank_timeout: float,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        rank_processes: Mapping[int, tuple[str, int]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.pipelines = dict(pipelines)
        self.stop_event = stop
        self.rank_timeout = rank_timeout
        self.heartbeat_seconds = heartbeat_seconds
        self.rank_processes = dict(rank_processes or {})
        self._jobs = 0
        self._last_contact = time.monotonic()
        self._stopped = False

    # --- rank 0 -------------------------------------------------------------------------------

    def run(self, model: str, request: GenerationRequest, on_step: StepCallback | None = None,
            should_stop: StopCheck | None = None) -> Generation:
        """Run a validated request on every rank (rank 0 only); raises JobFailed, JobCancelled or RankLost.

        should_stop: asked after the encoding and at every agreement point; a reason it returns cancels
        the request on every rank (JobCancelled with that reason), and the service goes on.
        """
        self._require_main("run")
        if model not in self.pipelines:
            raise KeyError(f"no model '{model}' in this service; it has {', '.join(self.pipelines)}")
        self._jobs += 1
        message = Run(job=self._jobs, model=model, request=request)
        self._broadcast(message)
        return self._execute(message, on_step, should_stop)

    def keep_alive(self) -> None:
        """Send a heartbeat if the followers have not heard from rank 0 for `heartbeat_seconds`."""
        self._require_main("keep_alive")
        if self.ctx.is_distributed and time.monotonic() - self._last_contact >= self.heartbeat_seconds:
            self._broadcast(Heartbeat())

    def stop(self) -> None:
        """Release the followers (rank 0 only); calling it again does nothing."""
        self._require_main("stop")
        if not self._stopped:
            self._stopped = True
            self._broadcast(Stop())

    def hand_over(self, message: HandOver | Regroup) -> None:
        """Release the followers for a while (rank 0 only): their `follow()` returns `message`, and they come back
        to this service (or another one) as it says."""
        self._require_main("hand_over")
        self._broadcast(message)

    # --- ranks > 0 ----------------------------------------------------------------------------

    def follow(self) -> Stop | HandOver | Regroup:
        """Execute rank 0's requests until it sends Stop, HandOver or Regroup (ranks > 0), and return that message.
        Raises RankLost if rank 0 is gone."""
        if self.ctx.is_main:
            raise RuntimeError("follow() is for ranks > 0; rank 0 calls run()")
        while True:
            message = self._broadcast(None)
            if isinstance(message, (Stop, HandOver, Regroup)):
                return message
            if isinstance(message, Run):
                try:
                    self._execute(message, None, None)
                except JobFailed:  # JobCancelled too
                    pass  # rank 0 reports it; this rank waits for the next message

    # --- every rank ---------------------------------------------------------------------------

    def _execute(self, message: Run, on_step: StepCallback | None, should_stop: StopCheck | None
                 ) -> Generation | None:
        pipeline = self.pipelines[message.model]
        request = message.request
        started = time.perf_counter()

        def stop_reason(done: int) -> str | None:
            return should_stop(done, request.steps) if should_stop is not None else None

        # 1. Rank 0 encodes; its outcome (tensors, an error or a cancellation) reaches every rank in one broadcast.
        encoded, failure, cancelled = None, None, None
        if self.ctx.is_main:
            try:
                encoded = pipeline.encode(request)
                if self.ctx.is_distributed:
                    encoded = _to_cpu(encoded)
            except Exception as error:  # any failure drops the request on every rank
                traceback.print_exc()
                failure = f"rank 0 (encoding): {_short(error)}"
            cancelled = stop_reason(0)
            if cancelled is not None:
                encoded = None
        encoded, failure, cancelled = self._broadcast((encoded, failure, cancelled))
        if failure is not None:
            raise JobFailed(failure)
        if cancelled is not None:
            raise JobCancelled(cancelled)
        # 1b. Every rank runs the part of the encoding the pipeline splits over them (an input's VAE encode), and
        #     then meets the others, so that a failure there drops the request on every rank before denoising.
        #     They meet whether or not anything was split: a rank that fails alone must find the others there.
        failure = None
        try:
            encoded = pipeline.prepare(request, encoded)
        except Exception as error:  # agreed just below
            traceback.print_exc()
            failure = f"rank {self.ctx.global_rank} (encoding): {_short(error)}"
        self._agree(failure)
        encode_seconds = time.perf_counter() - started

        # 2. Every rank denoises; ranks agree after every step and once more after the loop.
        clock = _StepClock(self.ctx.device)

        def step_done(done: int, total: int) -> None:
            self._agree(None, stop_reason(done) if self.ctx.is_main else None)
            clock.mark()
            if on_step is not None:
                on_step(done, total)

        denoise_started = time.perf_counter()
        clock.start()
        try:
            latents = pipeline.denoise(request, encoded, step_done)
        except (JobFailed, RankLost):
            raise
        except Exception as error:  # met by the others at their next agreement point
            try:  # _agree always raises when given a failure: JobFailed, or RankLost
                self._agree(f"rank {self.ctx.global_rank}: {_short(error)}")
            except JobFailed:
                # The run goes on, so the operator gets the whole story in this rank's log.
                traceback.print_exception(error)
                raise
        self._agree(None)  # a failure after the last step meets the others here
        decode_started = time.perf_counter()
        step_seconds = (decode_started - denoise_started) / request.steps

        # 3. Rank 0 decodes (every rank, for a split decode), then every rank meets once more: a decode failure
        #    reaches them all, and rank 0 hands a result back only once it knows that no rank died meanwhile
        #    (else RankLost).
        result, failure = None, None
        if self.ctx.is_main or pipeline.decode_is_split(request):
            try:
                result = pipeline.decode(request, latents)
            except Exception as error:
                traceback.print_exc()
                failure = f"rank {self.ctx.global_rank} (decoding): {describe(error)}"
        memory = {self.ctx.global_rank: rank_memory_bytes(self.ctx.device)}
        if self.ctx.is_distributed:  # each rank's outcome, and its memory for the metrics (app.server.metrics)
            reports: list[tuple[str | None, dict[int, tuple[str, int]]] | None] = [None] * self.ctx.world_size
            self._collective(dist.all_gather_object, reports, (failure, memory), group=self.ctx.control_group)
            failure = next((report[0] for report in reports if report[0]), None)
            memory = {rank: used for report in reports for rank, used in report[1].items()}
        if failure is not None:
            raise JobFailed(failure)
        if not self.ctx.is_main:
            return None
        finished = time.perf_counter()
        steps = clock.seconds()
        return Generation(result=result, model=message.model, request=request,
                          seconds=finished - started, step_seconds=step_seconds,
                          computed_steps=pipeline.computed_steps(), rank_memory=memory,
                          stages=StageSeconds(encode=encode_seconds, steps=steps, decode=finished - decode_started))

    def _agree(self, failure: str | None, cancelled: str | None = None) -> None:
        """Agreement point: raise JobFailed if any rank failed, JobCancelled if any wants to stop (the
        service then ends) or rank 0 cancels the request (`cancelled`: why; the service goes on)."""
        flags = torch.tensor([int(self.stop_event.is_set()), int(failure is not None), int(cancelled is not None)],
                             dtype=torch.int64)
        if self.ctx.is_distributed:
            try:
                work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctx.control_group, async_op=True)
                work.wait(timeout=timedelta(seconds=self.rank_timeout))
            except Exception as error:  # a timeout or a closed connection
                if "timed out" in str(error).lower():
                    reason = f"another rank did not reach the agreement point within {self.rank_timeout:g} s"
                    raise RankLost(f"rank {self.ctx.global_rank}: {reason}") from error
                raise self._peer_lost(_short(error)) from error
        stop_wanted, failed, cancel_wanted = flags.tolist()
        if failed:
            reports: list[str | None] = [failure]
            if self.ctx.is_distributed:
                reports = [None] * self.ctx.world_size
                self._collective(dist.all_gather_object, reports, failure, group=self.ctx.control_group)
            raise JobFailed("; ".join(dict.fromkeys(r for r in reports if r)))
        if stop_wanted:
            self.stop_event.set()
            raise JobCancelled(STOPPED)
        if cancel_wanted:
            raise JobCancelled(cancelled or "cancelled on rank 0")

    def _broadcast(self, message: Any) -> Any:
        """Rank 0's `message` on every rank (the argument is ignored on ranks > 0)."""
        if not self.ctx.is_distributed:
            return message
        box = [message]
        self._collective(dist.broadcast_object_list, box, group_src=0, group=self.ctx.control_group)
        self._last_contact = time.monotonic()
        return box[0]

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as error:  # gloo raises RuntimeError when a peer is gone
            raise self._peer_lost(_short(error)) from error

    def lost_message(self, detail: str = "this rank was waiting for it when SIGTERM came") -> str:
        """Why this rank ends, for a SIGTERM that came while it was busy (app.ranks.stopping's watchdog; `detail`: what
        this rank was doing).

        Who sent the SIGTERM cannot be seen from here (torchrun after a rank's death, a person, a scheduler),
        so the message names only what is known: which rank's process is gone, and that SIGTERM came.
        """
        if self.dead_ranks(wait=0.0):
            return str(self._peer_lost(detail))
        return f"rank {self.ctx.global_rank}: stopped by SIGTERM while busy"

    def dead_ranks(self, wait: float = DEAD_RANK_WAIT_SECONDS) -> list[int]:
        """The ranks on this host whose process has exited, looking for up to `wait` seconds (a killed
        process closes its sockets a moment before it shows as dead)."""
        host = socket.gethostname()
        deadline = time.monotonic() + wait
        while True:
            dead = [rank for rank, (rank_host, pid) in sorted(self.rank_processes.items())
                    if rank != self.ctx.global_rank and rank_host == host and not process_running(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _peer_lost(self, detail: str) -> RankLost:
        """RankLost naming the dead ranks where they can be seen (same host), with the collective's `detail`."""
        dead = self.dead_ranks()
        names = ""
        if dead:
            # Only its absence is seen: whether it was killed or crashed is torchrun's to tell (its exit status).
            which = f"rank {dead[0]} is gone, its process" if len(dead) == 1 else \
                f"ranks {', '.join(map(str, dead))} are gone, their processes"
            names = f": {which} killed or crashed"
        return RankLost(f"rank {self.ctx.global_rank}: another rank died or closed its connection{names} ({detail})")

    def _require_main(self, what: str) -> None:
        if not self.ctx.is_main:
            raise RuntimeError(f"{what}() is for rank 0; ranks > 0 call follow()")

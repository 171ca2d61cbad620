"""The lockstep service on 2 spawned gloo ranks, with a stand-in pipeline whose failures we choose.

The stand-in does what a real pipeline does between ranks: one collective (a sum over ranks) inside
every denoising step, then on_step. Its prompt says what to break, e.g. "fail rank 1 step 2".
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.requests import GenerationRequest
from tests.helpers import join_ranks, spawn_ranks

RANK_TIMEOUT = 2.0
CONTROL_TIMEOUT = 3.0
"""The control group's own timeout: idle time beyond it must not end the run (heartbeats)."""


def request(prompt: str, steps: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, negative_prompt="", height=64, width=64, steps=steps, guidance=1.0,
                             seed=0, frames=1, fps=1)


class StandInPipeline:
    """encode: prompt length; denoise: doubles by summing over 2 ranks each step; decode: the number."""

    def __init__(self, rank: int, stop: threading.Event) -> None:
        self.rank = rank
        self.stop = stop

    def encode(self, req: GenerationRequest) -> torch.Tensor:
        if req.prompt == "fail encode":
            raise ValueError("cannot encode this")
        return torch.tensor([float(len(req.prompt))])

    def denoise(self, req: GenerationRequest, encoded: torch.Tensor, on_step) -> torch.Tensor:
        x = encoded.clone()
        for step in range(1, req.steps + 1):
            if req.prompt == f"fail rank {self.rank} before collective at step {step}":
                raise RuntimeError("broken before the collective")
            dist.all_reduce(x)
            if req.prompt in (f"fail rank {self.rank} at step {step}", f"fail every rank at step {step}"):
                raise RuntimeError("broken step")
            if req.prompt == f"stop on rank {self.rank} at step {step}":
                self.stop.set()
            on_step(step, req.steps)
        return x

    def decode(self, req: GenerationRequest, latents: torch.Tensor) -> float:
        return latents.item()

    def encode_is_split(self, req: GenerationRequest) -> bool:
        return req.prompt.startswith("split encode")  # every rank finishes the encoding (prepare)

    def prepare(self, req: GenerationRequest, encoded: torch.Tensor) -> torch.Tensor:
        if req.prompt == f"split encode failing on rank {self.rank}":
            raise RuntimeError("cannot finish the encoding")
        return encoded + 1 if self.encode_is_split(req) else encoded

    def decode_is_split(self, req: GenerationRequest) -> bool:
        return False  # rank 0 decodes

    def computed_steps(self) -> None:
        return None  # no step cache


def outcome(fn) -> str:
    try:
        return f"ok {fn()}"
    except Exception as error:  # the test compares outcomes by name and message
        return f"{type(error).__name__}: {error}"


def _worker(rank: int, world_size: int, port: int, out_dir: str, scenario: str) -> None:
    join_ranks(rank, world_size, port)
    from app.ranks.lockstep import LockstepService
    from engines.parallel.distributed import ParallelContext

    dist.init_process_group("gloo")
    ctx = ParallelContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"),
                          group=dist.group.WORLD,
                          control_group=dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT)))
    stop = threading.Event()
    service = LockstepService(ctx, {"m": StandInPipeline(rank, stop)}, stop=stop, rank_timeout=RANK_TIMEOUT,
                              heartbeat_seconds=0.5)
    results = {}
    if rank == 1:
        results["follow"] = outcome(service.follow)
        Path(out_dir, "rank1.json").write_text(json.dumps(results))
        if results["follow"].startswith("RankLost"):
            os._exit(0)  # a lost run cannot tear its process group down
        dist.destroy_process_group()
        return

    def run(prompt: str, steps: int = 3):
        return lambda: service.run("m", request(prompt, steps)).result

    if scenario == "recoverable":
        steps_seen = []
        results["ok"] = outcome(lambda: service.run("m", request("hello"), lambda d, t: steps_seen.append(d)).result)
        results["steps_seen"] = steps_seen
        results["fail_step"] = outcome(run("fail rank 1 at step 2"))
        results["fail_both"] = outcome(run("fail every rank at step 1"))
        results["fail_encode"] = outcome(run("fail encode"))
        results["fail_prepare"] = outcome(run("split encode failing on rank 1"))
        generation = service.run("m", request("split encode"))
        results["split_encode"] = generation.result
        results["stages"] = [len(generation.stages.steps), generation.stages.encode > 0, generation.stages.decode > 0]
        idle_until = time.monotonic() + CONTROL_TIMEOUT + 1.5
        while time.monotonic() < idle_until:
            service.keep_alive()
            time.sleep(0.1)
        results["after_idle"] = outcome(run("hello again"))
        results["stop"] = outcome(run("stop on rank 1 at step 2"))
        results["stop_seen_on_rank0"] = stop.is_set()
        service.stop()
        dist.destroy_process_group()
    else:  # "lost": rank 1 fails where rank 0 waits in a collective, so they never meet
        started = time.monotonic()
        results["lost"] = outcome(run("fail rank 1 before collective at step 2"))
        results["seconds"] = time.monotonic() - started
    Path(out_dir, "rank0.json").write_text(json.dumps(results))
    if scenario == "lost":
        os._exit(0)


def run_scenario(scenario: str, tmp_path: Path) -> tuple[dict, dict]:
    spawn_ranks(_worker, 2, str(tmp_path), scenario)
    return (json.loads((tmp_path / "rank0.json").read_text()), json.loads((tmp_path / "rank1.json").read_text()))


def test_failures_are_dropped_together_and_the_service_goes_on(tmp_path):
    rank0, rank1 = run_scenario("recoverable", tmp_path)
    assert rank0["ok"] == "ok 40.0"  # len("hello") = 5, doubled at each of 3 steps
    assert rank0["steps_seen"] == [1, 2, 3]
    assert rank0["fail_step"] == "JobFailed: rank 1: RuntimeError: broken step"
    assert rank0["fail_both"] == "JobFailed: rank 0: RuntimeError: broken step; rank 1: RuntimeError: broken step"
    assert rank0["fail_encode"] == "JobFailed: rank 0 (encoding): ValueError: cannot encode this"
    assert rank0["fail_prepare"] == "JobFailed: rank 1 (encoding): RuntimeError: cannot finish the encoding"
    assert rank0["split_encode"] == (len("split encode") + 1) * 8  # prepared on every rank, then 3 steps
    assert rank0["stages"] == [3, True, True]  # where the time went: each step, encode, decode
    # idle longer than the control group's own timeout: the heartbeat keeps the run alive
    assert rank0["after_idle"] == "ok 88.0"
    assert rank0["stop"].startswith("JobCancelled")
    assert rank0["stop_seen_on_rank0"] is True
    assert rank1["follow"] == "ok Stop()"  # released by service.stop(), not by an error


def test_ranks_that_cannot_meet_end_the_run_within_the_rank_timeout(tmp_path):
    rank0, rank1 = run_scenario("lost", tmp_path)
    assert rank1["follow"].startswith("RankLost: rank 1: another rank did not reach the agreement point within 2 s")
    assert rank0["lost"].startswith("RankLost: rank 0: another rank died or closed its connection")
    assert rank0["seconds"] < RANK_TIMEOUT + 10


def test_the_cli_offers_the_engines_strategies_and_transports():
    from app.commands.arguments import STRATEGIES, TRANSPORTS
    from engines.parallel.copy_engine import TRANSPORTS as ENGINE_TRANSPORTS
    from engines.parallel.plan import STRATEGIES as ENGINE_STRATEGIES

    assert STRATEGIES == ENGINE_STRATEGIES
    assert TRANSPORTS == ENGINE_TRANSPORTS

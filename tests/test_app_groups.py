"""Replica groups on 4 spawned gloo ranks (2 groups of 2), with the lockstep tests' stand-in pipeline.

Rank 0 keeps the queue and leads group 1; rank 2 leads group 2 (app.ranks.groups). Requests sent together run
side by side, a request that fails in one group is that group's alone, and a cancel reaches the other
group's leader.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers import join_ranks, spawn_ranks
from tests.test_app_lockstep import StandInPipeline, request

STEP_SECONDS = 0.1


class GroupStandIn(StandInPipeline):
    """The stand-in of one group: each step sums over the group's ranks (as a real engine's collectives do),
    after a pause, so that requests last long enough to overlap; "fail the second rank at step k" breaks the
    group's second rank, whichever group runs it."""

    def __init__(self, rank: int, group_rank: int, group, stop: threading.Event) -> None:
        super().__init__(rank, stop)
        self.group_rank = group_rank
        self.group = group

    def denoise(self, req, encoded, on_step):
        x = encoded.clone()
        for step in range(1, req.steps + 1):
            time.sleep(STEP_SECONDS)
            if self.group is not None:  # None: a group of one rank
                dist.all_reduce(x, group=self.group)
            if req.prompt == f"fail the second rank at step {step}" and self.group_rank == 1:
                raise RuntimeError("broken step")
            on_step(step, req.steps)
        return x


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from app.ranks.groups import Layout, RemoteGroup, lead, make_links
    from app.ranks.lockstep import LockstepService
    from app.ranks.runtime import Runtime
    from app.server.jobs import JobQueue, serve_jobs
    from engines.parallel.distributed import ParallelContext, split_replicas

    dist.init_process_group("gloo")
    world = ParallelContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                            group=dist.group.WORLD, control_group=dist.new_group(backend="gloo"))
    ctx = split_replicas(world, 2)
    links = make_links(2, ctx.world_size, rank)
    stop = threading.Event()
    pipeline = GroupStandIn(ctx.global_rank, ctx.rank, ctx.group, stop)
    service = LockstepService(ctx, {"m": pipeline}, stop=stop, rank_timeout=5.0)
    if rank != 0:
        if ctx.is_main:
            lead(service, links[ctx.replica])
            service.stop()
        else:
            service.follow()
        dist.barrier()
        dist.destroy_process_group()
        return
    layout = Layout(replicas=2, world_size=world_size, service=service, plan="ulysses-2", links=links)
    runtime = Runtime(layouts=[layout], models={}, world_size=world_size, is_main=True, backend="gloo")
    layout.remote.append(RemoteGroup(links[1], leader=2, label=layout.label(1)))
    jobs = JobQueue(max_waiting=8)
    spans: dict[str, list[float]] = {}
    outcomes: dict[str, str] = {}

    def ended(job, outcome) -> None:
        spans[job.request.prompt] = [job.started_at, time.monotonic(), job.group]
        outcomes[job.request.prompt] = f"ok {outcome.result}" if not isinstance(outcome, str) else outcome

    for prompt, steps in (("hello", 6), ("hello!", 6), ("fail the second rank at step 2", 6), ("still fine", 6),
                          ("after the failure", 2)):
        jobs.submit("m", request(prompt, steps=steps))
    cancelled = jobs.submit("m", request("a long one", steps=40))

    def cancel_later() -> None:
        while cancelled.steps_done < 2:
            time.sleep(0.01)
        cancelled.cancel("cancelled by the client")

    threading.Thread(target=cancel_later, daemon=True).start()
    serve_jobs(runtime, jobs, stop, None, until_drained=True, on_end=ended)
    runtime.release()
    Path(out_dir, "rank0.json").write_text(json.dumps({"spans": spans, "outcomes": outcomes,
                                                       "cancelled_after": cancelled.steps_done}))
    dist.barrier()
    dist.destroy_process_group()


def test_groups_run_requests_side_by_side_and_keep_failures_to_themselves(tmp_path):
    spawn_ranks(_worker, 4, str(tmp_path))
    result = json.loads((tmp_path / "rank0.json").read_text())
    spans, outcomes = result["spans"], result["outcomes"]
    (start_a, end_a, group_a), (start_b, end_b, group_b) = spans["hello"], spans["hello!"]
    assert {group_a, group_b} == {"group 1 of 2 (ranks 0-1)", "group 2 of 2 (ranks 2-3)"}
    assert start_a < end_b and start_b < end_a  # both started before either ended
    assert outcomes["hello"] == f"ok {5 * 2 ** 6:.1f}" and outcomes["hello!"] == f"ok {6 * 2 ** 6:.1f}"
    failed_on = spans["fail the second rank at step 2"][2]
    second = 1 if failed_on.startswith("group 1") else 3
    assert outcomes["fail the second rank at step 2"] == f"rank {second}: RuntimeError: broken step"
    # the other group went on meanwhile, and the failing one serves the next request
    assert outcomes["still fine"].startswith("ok") and outcomes["after the failure"].startswith("ok")
    fail_start, fail_end, _ = spans["fail the second rank at step 2"]
    fine_start, fine_end, fine_on = spans["still fine"]
    assert fine_on != failed_on and fine_start < fail_end and fail_start < fine_end
    assert outcomes["a long one"].startswith("cancelled by the client (asked after step")
    assert result["cancelled_after"] <= 4  # stopped within 2 steps of the cancel


def _regrouping_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """`--replicas auto` on the stand-in: layouts of 1, 2 and 4 groups, moved between by rank 0's queue."""
    join_ranks(rank, world_size, port)
    from app.ranks.groups import Layout, RemoteGroup, make_links
    from app.ranks.lockstep import LockstepService
    from app.ranks.runtime import Runtime
    from app.server.jobs import JobQueue, serve_jobs
    from engines.parallel.distributed import ParallelContext, split_replicas

    dist.init_process_group("gloo")
    world = ParallelContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                            group=dist.group.WORLD, control_group=dist.new_group(backend="gloo"))
    stop = threading.Event()
    layouts = []
    for count in (1, 2, 4):
        ctx = split_replicas(world, count)
        links = make_links(count, ctx.world_size, rank)
        pipeline = GroupStandIn(ctx.global_rank, ctx.rank, ctx.group, stop)
        service = LockstepService(ctx, {"m": pipeline}, stop=stop, rank_timeout=5.0)
        layouts.append(Layout(replicas=count, world_size=world_size, service=service, plan=f"ulysses-{4 // count}",
                              links=links, named=True))
    runtime = Runtime(layouts=layouts, models={}, world_size=world_size, is_main=rank == 0, backend="gloo")
    if rank != 0:
        runtime.follow()
        dist.barrier()
        dist.destroy_process_group()
        return
    for index, layout in enumerate(layouts):
        layout.remote.extend(RemoteGroup(link, leader=replica * layout.group_size, label=layout.label(replica),
                                         listen=index == 0) for replica, link in sorted(layout.links.items()))
    runs: list[dict] = []

    def ended(job, outcome) -> None:
        runs.append({"prompt": job.request.prompt, "group": job.group, "plan": job.plan, "ranks": job.ranks,
                     "start": job.started_at, "end": time.monotonic(),
                     "result": None if isinstance(outcome, str) else float(outcome.result)})

    def wave(prompts: list[str]) -> None:
        jobs = JobQueue(max_waiting=8)
        for prompt in prompts:
            jobs.submit("m", request(prompt, steps=3))
        serve_jobs(runtime, jobs, stop, None, until_drained=True, on_end=ended)

    wave(["alone"])
    wave(["one", "two", "three", "four"])
    wave(["pair a", "pair b"])
    wave(["alone again"])
    runtime.release()
    Path(out_dir, "rank0.json").write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


def test_the_ranks_regroup_as_the_queue_grows_and_drains(tmp_path):
    spawn_ranks(_regrouping_worker, 4, str(tmp_path))
    runs = {run["prompt"]: run for run in json.loads((tmp_path / "rank0.json").read_text())}
    assert len(runs) == 8
    # a lone request: every rank as one group (each step sums over the group's 4 ranks)
    for prompt in ("alone", "alone again"):
        assert runs[prompt]["group"] == "all 4 ranks" and runs[prompt]["plan"] == "ulysses-4", runs[prompt]
        assert runs[prompt]["ranks"] == 4 and runs[prompt]["result"] == len(prompt) * 4.0 ** 3
    # four at once: four groups of one rank, side by side
    four = [runs[p] for p in ("one", "two", "three", "four")]
    assert sorted(run["group"] for run in four) == [f"group {i} of 4 (rank {i - 1})" for i in range(1, 5)]
    assert all(run["ranks"] == 1 and run["plan"] == "ulysses-1" for run in four)
    assert max(run["start"] for run in four) < min(run["end"] for run in four)  # all started before any ended
    assert all(run["result"] == float(len(run["prompt"])) for run in four)
    # two at once: two groups of two
    pair = [runs["pair a"], runs["pair b"]]
    assert sorted(run["group"] for run in pair) == ["group 1 of 2 (ranks 0-1)", "group 2 of 2 (ranks 2-3)"]
    assert all(run["result"] == len(run["prompt"]) * 2.0 ** 3 for run in pair)

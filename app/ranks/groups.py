"""Replica groups: the run's ranks as several groups side by side, each running its own requests.

With `--replicas R` the ranks form R equal groups of consecutive ranks (engines.parallel.distributed.split_replicas),
each with its own plan, its own lockstep service (app.ranks.lockstep) and its leader, its lowest rank. Rank 0
talks to the user (UI, API, batch file) and keeps the one queue; it leads group 1 itself and hands whole
requests to the other leaders, which run them in their group and send back each step and the result:

    rank 0 -> leader:  Run(job, model, request) | Cancel(job, reason) | HandOver() | Stop()
    leader -> rank 0:  Stepped(job, done, total) ... then Done(job, generation or failure) | Lost(message);
                       HandOver() and Stop() answered in kind

Each direction has its own two-rank gloo group, so that one thread of each side only sends and another
only receives; a group's lockstep never waits on another group. Cancelling (a client that left, the time
limit) is rank 0's decision as before: it sends Cancel, and the leader's group drops the request at its
next agreement point. A request that fails in one group is that group's alone; a lost rank ends the run,
as it does with one group.

With `--replicas auto` the run has several layouts (Layout: one per group size), each with its own groups, services
and channels. The ranks are in one layout at a time; rank 0 moves them (app.ranks.runtime.Runtime.regroup) when every
group is idle: each leader is handed over (HandOver: it releases its group, whose ranks leave their service), and every
rank meets on the one-group layout's service, where Regroup(layout) sends them to the next layout.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from app.failures import JobCancelled, JobFailed, RankLost, describe
from app.ranks.lockstep import Generation, HandOver, LockstepService, Run, StepCallback, Stop, StopCheck
from engines.parallel.distributed import cpu_group
from pipelines.requests import GenerationRequest

POLL_SECONDS = 0.2
"""How often a waiting side looks at its stop flag (and an idle leader heartbeats its group)."""


@dataclass(frozen=True)
class Cancel:
    job: int
    reason: str


@dataclass(frozen=True)
class Stepped:
    job: int
    done: int
    total: int


@dataclass(frozen=True)
class Done:
    job: int
    generation: Generation | None = None
    failure: str | None = None
    cancelled: bool = False


@dataclass(frozen=True)
class Lost:
    message: str


class Channel:
    """Objects one way between rank 0 and a group's leader, over their own two-rank gloo group."""

    def __init__(self, group: dist.ProcessGroup, peer: int) -> None:
        self._group = group
        self._peer = peer
        """The other side's rank in the two-rank group."""

    def send(self, message: Any) -> None:
        dist.send_object_list([message], group=self._group, group_dst=self._peer)

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, group=self._group, group_src=self._peer)
        return box[0]


@dataclass(frozen=True)
class Link:
    """Rank 0's channels with one leader: `down` to it, `up` from it."""

    down: Channel
    up: Channel


@dataclass(kw_only=True)
class Layout:
    """One way the run's ranks form groups: `replicas` equal groups of consecutive ranks, each with its plan, running
    its own requests. A run has one layout (`--replicas R`), or, with `--replicas auto`, one per group size its plan
    allows, every rank as one group first; rank 0 moves the ranks between them as its queue grows and drains
    (app.ranks.runtime.Runtime.regroup)."""

    replicas: int
    world_size: int
    """Ranks of the run."""
    service: LockstepService
    """This rank's group's lockstep service in this layout."""
    plan: str
    """How a group of this layout splits each transformer, e.g. 'ulysses-2, all-to-all gloo' or 'none (1 rank)'."""
    links: dict[int, Link] = field(default_factory=dict)
    """A group's leader other than rank 0: its channels with rank 0 (under its group's index); rank 0: every other
    group's, which its RemoteGroups use."""
    remote: list[RemoteGroup] = field(default_factory=list)
    """Rank 0: a handle on every group of this layout it does not lead."""
    named: bool = False
    """Whether one group is named too (where the run regroups, every request says where it ran)."""

    @property
    def group_size(self) -> int:
        return self.world_size // self.replicas

    def label(self, replica: int) -> str:
        """E.g. "group 2 of 2 (ranks 2-3)", "all 4 ranks" (a run that regroups); "" for a run of one group."""
        size = self.group_size
        if self.replicas == 1:
            return f"all {size} ranks" if self.named else ""
        first, last = replica * size, (replica + 1) * size - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        return f"group {replica + 1} of {self.replicas} ({ranks})"

    def describe(self) -> str:
        """E.g. "ulysses-2, all-to-all gloo in 2 groups of 2"."""
        if self.replicas == 1:
            return self.plan
        return f"{self.plan} in {self.replicas} groups of {self.group_size}"


def make_links(replicas: int, group_size: int, rank: int) -> dict[int, Link]:
    """Channels between rank 0 and the leader of every other group (collective: every rank calls it, in the
    same order). Rank 0 gets one Link per other group (by group index), such a leader its own, others none."""
    links: dict[int, Link] = {}
    for replica in range(1, replicas):
        leader = replica * group_size
        down, up = cpu_group([0, leader]), cpu_group([0, leader])
        if rank == 0:
            links[replica] = Link(down=Channel(down, 1), up=Channel(up, 1))
        elif rank == leader:
            links[replica] = Link(down=Channel(down, 0), up=Channel(up, 0))
    return links


def _receive_into(channel: Channel, inbox: queue.Queue, who: str) -> None:
    """A receiving thread: every message into `inbox`; a closed connection becomes a Lost message."""
    while True:
        try:
            message = channel.receive()
        except Exception as error:  # gloo raises when the other side is gone
            inbox.put(Lost(f"{who} is gone ({describe(error).split('. This is typically')[0]})"))
            return
        inbox.put(message)
        if isinstance(message, (Stop, HandOver, Lost)):
            return


class RemoteGroup:
    """Rank 0's handle on a group another rank leads: `run` runs a request there as LockstepService.run would."""

    def __init__(self, link: Link, *, leader: int, label: str, listen: bool = True) -> None:
        self.label = label
        self.leader = leader
        self._link = link
        self._events: queue.Queue = queue.Queue()
        self._jobs = 0
        self._receiver: threading.Thread | None = None
        self._released = False
        if listen:
            self.listen()

    def listen(self) -> None:
        """Start hearing the leader (at start, or when rank 0 forms this group again after a hand_over)."""
        self._receiver = threading.Thread(target=_receive_into, name=f"from-rank-{self.leader}", daemon=True,
                                          args=(self._link.up, self._events,
                                                f"rank {self.leader} (leader of {self.label})"))
        self._receiver.start()

    def hand_over(self, timeout: float = 30.0) -> None:
        """The group is idle and its ranks are to be grouped another way: tell the leader (it releases its group)
        and wait for its answer; RankLost if it does not come."""
        self._send(HandOver())
        while True:
            try:
                message = self._event(timeout=timeout)
            except queue.Empty:
                raise RankLost(f"rank 0: rank {self.leader} (leader of {self.label}) did not answer within "
                               f"{timeout:g} s") from None
            if isinstance(message, HandOver):
                self._receiver.join(timeout=timeout)
                self._receiver = None
                return

    def run(self, model: str, request: GenerationRequest, on_step: StepCallback | None = None,
            should_stop: StopCheck | None = None) -> Generation:
        """Run a validated request on the group; raises JobFailed, JobCancelled or RankLost, as the local service."""
        ask = should_stop or (lambda done, total: None)
        reason = ask(0, request.steps)
        if reason is not None:
            raise JobCancelled(reason)
        self._jobs += 1
        job = self._jobs
        self._send(Run(job, model, request))
        cancelled = False
        while True:
            message = self._event()
            if getattr(message, "job", job) != job:
                continue  # what an earlier, cancelled job still said
            if isinstance(message, Stepped):
                if on_step is not None:
                    on_step(message.done, message.total)
                reason = ask(message.done, message.total)
                if reason is not None and not cancelled:
                    cancelled = True
                    self._send(Cancel(job, reason))
            elif isinstance(message, Done):
                if message.generation is not None:
                    return message.generation
                raise (JobCancelled if message.cancelled else JobFailed)(message.failure or "failed")

    def release(self, timeout: float = 5.0) -> None:
        """The run is over: tell the leader (it releases its group and ends) and wait for its answer, so that no
        receive is left pending when the process group goes. Calling it again does nothing."""
        if self._released or self._receiver is None:  # not formed now: its leader waits elsewhere
            return
        self._released = True
        try:
            self._link.down.send(Stop())
        except Exception:  # a leader that is gone needs no release
            return
        self._receiver.join(timeout=timeout)

    def keep_alive(self) -> None:
        """While the group is idle: RankLost if its leader (or a rank of its group) is gone; what an earlier,
        cancelled request still said is dropped."""
        while True:
            try:
                self._event(block=False)
            except queue.Empty:
                return

    def _event(self, block: bool = True, timeout: float | None = None) -> Any:
        """The leader's next message (queue.Empty if none comes); RankLost if it says that the group is lost."""
        message = self._events.get(block, timeout)
        if isinstance(message, Lost):
            raise RankLost(f"rank 0: {message.message}")
        return message

    def _send(self, message: Any) -> None:
        try:
            self._link.down.send(message)
        except Exception as error:  # the leader is gone
            raise RankLost(f"rank 0: rank {self.leader} (leader of {self.label}) is gone "
                           f"({describe(error)})") from error


def lead(service: LockstepService, link: Link) -> Stop | HandOver:
    """A group leader other than rank 0: run rank 0's requests on this group until rank 0 says Stop or HandOver
    (returned, once answered; the caller releases its group).

    Raises RankLost if rank 0 is gone (or a rank of this group, which rank 0 is told first). A Ctrl-C reaches
    every rank: the group's lockstep service stops the request it runs at its next agreement point."""
    inbox: queue.Queue = queue.Queue()
    rank = service.ctx.global_rank
    threading.Thread(target=_receive_into, args=(link.down, inbox, "rank 0"), name="from-rank-0",
                     daemon=True).start()
    later: list[Any] = []
    """Messages that came during a request and are for after it (a Stop)."""
    while True:
        try:
            message = later.pop(0) if later else inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            service.keep_alive()
            continue
        if isinstance(message, (Stop, HandOver)):
            _tell(link, message)  # rank 0's receiving thread ends with it
            return message
        if isinstance(message, Lost):
            raise RankLost(f"rank {rank}: {message.message}")
        if not isinstance(message, Run):
            continue  # a Cancel for a request that is over
        job = message.job
        wanted: list[str] = []

        def should_stop(done: int, total: int, job: int = job, wanted: list[str] = wanted) -> str | None:
            while True:
                try:
                    news = inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(news, Cancel) and news.job == job:
                    wanted.append(news.reason)
                elif isinstance(news, (Stop, Lost)):
                    later.append(news)
                    wanted.append("the server is shutting down")
            return wanted[0] if wanted else None

        def on_step(done: int, total: int, job: int = job) -> None:
            link.up.send(Stepped(job, done, total))

        try:
            generation = service.run(message.model, message.request, on_step=on_step, should_stop=should_stop)
        except RankLost as error:
            _tell(link, Lost(str(error)))
            raise
        except JobFailed as error:  # JobCancelled too
            answer = Done(job, failure=str(error), cancelled=isinstance(error, JobCancelled))
        except Exception as error:  # anything else is this group's failure, not the run's
            traceback.print_exc()
            answer = Done(job, failure=f"rank {rank}: {describe(error)}")
        else:
            answer = Done(job, generation=generation)
        _tell(link, answer)


def _tell(link: Link, message: Any) -> None:
    try:
        link.up.send(message)
    except Exception as error:  # rank 0 is gone: this leader ends at its next receive
        print(f"could not tell rank 0: {describe(error)}", file=sys.stderr, flush=True)

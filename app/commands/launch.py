"""`ulysses-studio launch [--nproc N] COMMAND ...`: run serve, batch or generate on N ranks with torchrun.

    torchrun --nproc-per-node N --master-addr 127.0.0.1 --master-port <free> -m app COMMAND ...

(run as `python -m app.commands.torchrun`: torchrun, ending its process without its interpreter's last second of
clean-up). N defaults to the visible GPUs, or 2 CPU ranks (gloo) on a machine without one. The command line is
checked here first, so a mistake is one line before any rank starts. So are the models' weights against
the GPUs' memory (app/commands/memory_plan.py): without --tp the ranks get the smallest tp degree that fits, and a
model that fits no degree is refused with the memory it would need. The environment is passed on
as it is (NCCL_*, CUDA_VISIBLE_DEVICES, ...); on CPUs OMP_NUM_THREADS defaults to cores / N.

Ctrl-C: torchrun runs in its own session, so the terminal's SIGINT reaches only this launcher, which
passes it to the ranks; they stop together at their next agreement point and exit cleanly (torchrun,
interrupted itself, would print a traceback). A second Ctrl-C kills torchrun and its ranks at once (each
rank by its own process group: torchrun starts every rank in a session of its own, so killing torchrun's
group would leave them running).
Exit status: torchrun treats any non-zero rank exit as a crash (and prints a traceback), so under
this launcher rank 0 writes its command's status (0, 1 for a partly failed batch, 2 for a user error,
130 after Ctrl-C) to the file named by $ULYSSES_STUDIO_EXIT_STATUS_FILE and exits 0; the launcher
exits with that status. When a rank dies, torchrun notices within 0.1 s and sends SIGTERM to the others;
they report and exit within about 3 s (app.ranks.stopping), and this launcher reports the failure in one
line. torchrun's own SIGKILL comes only 30 s later, so the launcher watches the ranks too: when one
has exited and the others still run RANK_EXIT_GRACE_SECONDS later, it kills them itself.

A server's login (--auth or $ULYSSES_STUDIO_AUTH) is not passed on as given: the launcher writes it to
a file only this user can read, in its temporary folder, and the ranks get `--auth-file` with that
path, so that no rank's command line or environment holds the password.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from app.commands.arguments import run_options
from app.commands.torchrun import free_port, remove_ended_logs
from app.ranks.stopping import process_running, temporary_folder
from app.server.access import AUTH_ENV, read_logins, write_private_auth_file

LAUNCHABLE = ("serve", "batch", "generate")
EXIT_STATUS_ENV = "ULYSSES_STUDIO_EXIT_STATUS_FILE"
"""Set by the launcher for its ranks: rank 0 writes its exit status there and exits 0 (see hand_over_exit_status)."""
DEFAULT_CPU_RANKS = 2
RANK_EXIT_GRACE_SECONDS = 4.0
"""How long the other ranks may run after one rank exited (they normally follow within a second)."""
POLL_SECONDS = 0.1


class LaunchError(ValueError):
    """A launch command line that cannot start."""


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help=f"ranks to start (default: the visible GPUs, or {DEFAULT_CPU_RANKS} CPU ranks "
                             "without one)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory per GPU to plan for, in GiB (default: the least free memory of the visible GPUs; "
                             "none on a machine without one): without --tp, the command runs with the smallest tp "
                             "degree whose weights fit, and a model that fits no degree is refused before loading")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="hosts taking part (default 1): run the same launch command on each, with its own "
                             "--node-rank, --nproc ranks on each (docs/groups-and-hosts.md)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="K",
                        help="this host's place, 0 to N-1: host 0 holds rank 0, which serves the UI and the API")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="with several hosts: host 0's address and a free port there, where the hosts meet")
    parser.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                        help=f"one of {', '.join(LAUNCHABLE)} and its arguments")


def default_nproc() -> int:
    """The number of visible GPUs, or DEFAULT_CPU_RANKS where there is none."""
    from app.commands.memory_plan import visible_gpus

    return visible_gpus() or DEFAULT_CPU_RANKS


def torchrun_command(nproc: int, command_line: list[str], port: int, *, nnodes: int = 1, node_rank: int = 0,
                     address: str = "127.0.0.1") -> list[str]:
    """The torchrun command line (app.commands.torchrun: torchrun that exits at once) that starts `nproc` ranks of
    `python -m app COMMAND ...` on this host, host `node_rank` of `nnodes` meeting at address:port.

    The hosts meet by torchrun's static rendezvous: host K's ranks are K*nproc ... K*nproc+nproc-1, so rank 0,
    which serves the UI, is on host 0, and a group of consecutive ranks stays inside a host."""
    return [
        sys.executable, "-m", "app.commands.torchrun",
        f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--max-restarts=0",
        f"--master-addr={address}", f"--master-port={port}",
        "-m", "app", *command_line,
    ]


def check_hosts(args: argparse.Namespace, inner: argparse.Namespace, nproc: int) -> tuple[str, int]:
    """The rendezvous address and port of a launch on several hosts (this host's own free port for one), and
    LaunchError where a group's context parallelism or tp would have to span hosts."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank must be from 0 to --nnodes - 1 ({args.nnodes - 1}), got {args.node_rank}")
    if args.nnodes == 1:
        return "127.0.0.1", free_port(avoid=getattr(inner, "port", None))
    if not args.rdzv_endpoint or ":" not in args.rdzv_endpoint:
        raise LaunchError("several hosts meet at --rdzv-endpoint HOST:PORT: host 0's address and a free port there")
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--rdzv-endpoint {args.rdzv_endpoint}: the port must be a number from 1 to 65535")
    if int(port) == getattr(inner, "port", None):
        raise LaunchError(f"--rdzv-endpoint's port {port} is the one serve listens on (--port): give them two ports")
    replicas = getattr(inner, "replicas", None)
    if replicas == "auto":
        raise LaunchError("--replicas auto regroups the ranks of one host; on several hosts give --replicas R (a "
                          f"multiple of --nnodes {args.nnodes}), or leave it out for one group per host")
    world = nproc * args.nnodes
    replicas = replicas or args.nnodes  # the default on several hosts: one group per host
    if world % replicas:
        raise LaunchError(f"--replicas {replicas}: {world} ranks on {args.nnodes} hosts cannot form equal groups")
    # A group's cfg halves may span hosts; its sequence and weight splits (ring x ulysses x tp) may not.
    inside = world // replicas // (2 if inner.cfg_parallel else 1)
    if inside > nproc or nproc % inside:
        raise LaunchError(f"{world} ranks on {args.nnodes} hosts in {replicas} group(s): each group's context "
                          f"parallelism and tp ({inside} ranks) would span hosts; use more --replicas (or "
                          f"--cfg-parallel), so that it fits in the {nproc} ranks of a host")
    return host, int(port)


def run_launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check the inner command line, start torchrun, relay Ctrl-C, and return torchrun's exit status."""
    command_line = list(args.command_line)
    if command_line[:1] == ["--"]:
        command_line = command_line[1:]
    if not command_line or command_line[0] not in LAUNCHABLE:
        raise LaunchError(f"launch needs a command: one of {', '.join(LAUNCHABLE)} (e.g. `launch --nproc 2 serve`)")
    inner = parser.parse_args(command_line)
    if inner.command == "serve" and args.node_rank > 0:  # only host 0 listens: its port is none of this host's
        from app.server.serve import serve_plan

        checked = serve_plan(inner)
    else:
        checked = inner.check(inner)  # user mistakes end here, in one line, before any rank starts
    run_options(inner)

    from app.commands.memory_plan import visible_gpus

    cuda = visible_gpus() > 0
    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    address, port = check_hosts(args, inner, nproc)
    replicas = getattr(inner, "replicas", None)
    if isinstance(replicas, int) and (nproc * args.nnodes) % replicas:
        raise LaunchError(f"--replicas {replicas}: --nproc {nproc} ranks cannot form {replicas} equal groups")
    if inner.tp is not None and nproc % inner.tp:
        raise LaunchError(f"--tp {inner.tp} splits the weights over groups of {inner.tp} ranks: --nproc {nproc} is "
                          f"not a multiple of it")
    if inner.tp is not None and inner.cfg_parallel and (nproc // inner.tp) % 2:
        raise LaunchError(f"--cfg-parallel needs an even number of tp groups: --nproc {nproc} over --tp {inner.tp} "
                          f"makes {nproc // inner.tp}")
    command_line += plan_memory(checked, inner.tp, nproc, args.gpu_memory, cuda, groups=2 if inner.cfg_parallel else 1,
                                fp8=getattr(inner, "fp8", False))
    env = dict(os.environ)
    if not cuda:
        from app.ranks.runtime import cpu_threads_per_rank

        env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(nproc)))
    folder = temporary_folder("ulysses-studio-launch")
    try:
        if inner.command == "serve" and (inner.auth or env.get(AUTH_ENV)):
            logins = read_logins(inner.auth, None, env, warn=False)
            env.pop(AUTH_ENV, None)
            command_line = [*_without_option(command_line, "--auth"), "--auth-file",
                            str(write_private_auth_file(logins, folder / "logins"))]
        command = torchrun_command(nproc, command_line, port, nnodes=args.nnodes, node_rank=args.node_rank,
                                   address=address)
        hosts = f" on host {args.node_rank} of {args.nnodes}" if args.nnodes > 1 else ""
        print(f"launch: {nproc} rank{'s' if nproc > 1 else ''}{hosts} ({'GPU' if cuda else 'CPU, gloo'}): "
              f"{' '.join(command[1:])}", file=sys.stderr, flush=True)
        status_file = folder / "exit-status"
        env[EXIT_STATUS_ENV] = str(status_file)
        status, interrupts = _run_torchrun(command, env)
        if status != 0 and interrupts > 1:
            print("launch: stopped at once (a second Ctrl-C killed torchrun and its ranks)", file=sys.stderr)
            return 130
        # torchrun stopped by the signal that stopped this launcher too (sent to every process of the job): the ranks
        # were told to stop, and said how they ended in status_file
        stopped = interrupts > 0 and status in (128 + signal.SIGINT, 128 + signal.SIGTERM)
        if status != 0 and not stopped:
            print(f"error: the job ended because a rank failed (torchrun exit status {status}); "
                  "the messages above say which rank and why", file=sys.stderr)
            return status
        reported = int(status_file.read_text()) if status_file.is_file() else 0
        return 130 if interrupts and reported == 0 else reported
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def plan_memory(checked: object, tp: int | None, nproc: int, gpu_memory_gib: float | None, cuda: bool,
                groups: int = 1, fp8: bool = False) -> list[str]:
    """Check that the launched models' weights fit the GPUs (app.commands.memory_plan) and say with which tp; the
    `--tp N` to add to the command line where it gave none. On CPUs without --gpu-memory only a given --tp
    is checked (that it splits the models). `groups`: 2 with --cfg-parallel, `fp8`: the FP8 weights of --fp8 are
    counted (app.commands.memory_plan.choose_tp)."""
    from app.commands.memory_plan import MemoryPlanError, choose_tp, gpu_memory, rank_bytes
    from pipelines.memory import GIB

    models = list(checked.models) if hasattr(checked, "models") else [(checked.spec, checked.folder)]
    gpu_bytes = int(gpu_memory_gib * GIB) if gpu_memory_gib is not None else (gpu_memory() if cuda else None)
    try:
        if gpu_bytes is None:
            if tp:
                rank_bytes(models, tp)  # ValueError where tp does not split a model
            return []
        plan = choose_tp(models, nproc=nproc, gpu_bytes=gpu_bytes, requested=tp, groups=groups, fp8=fp8)
    except ValueError as error:
        raise LaunchError(f"--tp {tp}: {error}" if tp and not isinstance(error, MemoryPlanError)
                          else str(error)) from None
    print(f"launch: {plan.describe()}" + ("" if tp else " (the smallest tp that fits)"), file=sys.stderr, flush=True)
    return [] if tp else ["--tp", str(plan.tp)]


def _without_option(command_line: list[str], option: str) -> list[str]:
    """`command_line` without `option VALUE` and `option=VALUE` (exact spelling: check() has parsed it)."""
    kept, skip = [], False
    for word in command_line:
        if skip:
            skip = False
        elif word == option:
            skip = True
        elif not word.startswith(f"{option}="):
            kept.append(word)
    return kept


def hand_over_exit_status(status: int) -> int:
    """The exit status a rank should end with: under the launcher, rank 0 hands `status` to it and
    every rank returns 0, so torchrun does not report a crash; elsewhere `status` itself."""
    status_file = os.environ.get(EXIT_STATUS_ENV)
    if not status_file:
        return status
    if os.environ.get("RANK", "0") == "0":
        Path(status_file).write_text(str(status))
    return 0


def _run_torchrun(command: list[str], env: dict[str, str]) -> tuple[int, int]:
    """torchrun's exit status, and how many Ctrl-Cs or SIGTERMs this launcher received while it ran."""
    process = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    interrupts = []

    def relay(signum: int, frame: object) -> None:
        interrupts.append(signum)
        if len(interrupts) == 1:
            # A rank stops at its next step; an engine build or a weight load in progress finishes first (seconds to
            # minutes), which a silent terminal would leave unexplained.
            print("launch: stopping: each rank ends at its next step (a build or load in progress finishes first); "
                  "Ctrl-C again to end them at once", file=sys.stderr, flush=True)
            _signal_ranks(process.pid, signal.SIGINT)
        else:  # the user insists: end torchrun and its ranks now
            _kill_job(process.pid)

    previous = {sig: signal.signal(sig, relay) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _wait_for_ranks(process)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    remove_ended_logs()  # the log folder of a torchrun that _kill_job ended, which could not remove it itself
    return status, len(interrupts)


def _wait_for_ranks(torchrun: subprocess.Popen) -> int:
    """torchrun's exit status; if a rank exits and another still runs RANK_EXIT_GRACE_SECONDS later (stuck
    where it cannot answer torchrun's SIGTERM), SIGKILL them all rather than wait torchrun's 30 s."""
    seen: set[int] = set()
    first_exit = None
    while True:
        try:
            return torchrun.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        running = set(_children(torchrun.pid))
        if first_exit is None:
            if seen - running:
                first_exit = time.monotonic()
            seen |= running
        elif running and time.monotonic() - first_exit > RANK_EXIT_GRACE_SECONDS:
            print(f"launch: a rank exited and the others still ran {RANK_EXIT_GRACE_SECONDS:g} s later: "
                  "killing them", file=sys.stderr, flush=True)
            _kill_job(torchrun.pid)
            return torchrun.wait()


def _children(pid: int) -> list[int]:
    """The running (not exited) children of process `pid`, read from /proc (none where it is missing)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):
            children += [int(child) for child in task.read_text().split()]
    return [child for child in children if process_running(child)]


def _signal_ranks(torchrun_pid: int, sig: signal.Signals) -> None:
    """Send `sig` to torchrun's children (the ranks), or to its whole session where /proc is missing."""
    children = _children(torchrun_pid)
    if not children:
        os.killpg(torchrun_pid, sig)
    for pid in children:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def _kill_job(torchrun_pid: int) -> None:
    """SIGKILL the ranks, each with its process group (they lead sessions of their own), then torchrun's group."""
    for pid in _children(torchrun_pid):  # listed first: once torchrun dies they are no longer its children
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # not a group leader (a torchrun that keeps ranks in its own group)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.killpg(torchrun_pid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the torchrun child: get SIGTERM if this launcher dies (Linux), so no ranks are orphaned."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG

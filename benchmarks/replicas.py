"""Replica groups against one group, through the app itself: `launch ... batch` and `launch ... serve`.

    python -m benchmarks.replicas --model flux-dev --folder /tmp/flux-dev-random --gpus 4 --out OUT \
        [--sizes 512,1024] [--lines 64] [--steps 8] [--users 8] [--parts batch,serve]

The checkpoint folder is written first if it is missing: the model's published architecture with random weights
(every component, in a diffusers folder the app loads as it loads a real one; random weights measure speed
honestly, not quality). Then, for each size:

- batch: a prompt file of `--lines` lines, once with `--replicas 1` (every request on every GPU) and once with
  `--replicas auto`; images a minute from the times the manifest's lines appear, after each run's first `--gpus`
  images (which include compiling its engines), and the whole command's wall time;
- serve (the first size): a server with each setting; after a warm-up, each GPU's memory in use (what auto's
  extra layouts cost against one group's), a lone request LONE times (the medians of the client's latency and of
  the server's own seconds), and `--users` gradio_client users at once (their mean and worst latency).

Everything lands in OUT/replicas.json, the commands' logs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LONE = 9
"""Lone requests timed one after another (the median is kept: a client's latency varies by tens of ms)."""
PROMPTS = ("a red circle on a white background", "a blue square in a green field", "a yellow star above the sea",
           "an orange triangle beside a purple cube")


def write_random_checkpoint(name: str, folder: Path) -> None:
    """`name`'s published architecture with random bf16 weights (made on this GPU), saved as a diffusers folder
    with the embedded model's tokenizers, scheduler and model index."""
    import torch

    from benchmarks.generation import build_pipeline, real_components, write_config_folder

    arch = real_components(name)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_config_folder(arch, partial)
    pipeline = build_pipeline(arch, partial, device=torch.device("cuda"), with_encoders=True)
    for component in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        # a pipeline that runs diffusers' own prompt encoding (Wan) keeps its encoder in that pipeline
        module = getattr(pipeline, component, None) or getattr(getattr(pipeline, "_diffusers", None), component, None)
        if module is not None:
            module.save_pretrained(partial / component, max_shard_size="5GB")
    for part in ("scheduler", "tokenizer", "tokenizer_2", "text_tokenizer", "model_index.json"):
        source = arch.assets / part
        if source.is_dir():
            shutil.copytree(source, partial / part)
        elif source.exists():
            shutil.copy(source, partial / part)
    del pipeline
    torch.cuda.empty_cache()
    partial.rename(folder)


def _app(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_batch(args: argparse.Namespace, size: int, replicas: str, out: Path) -> dict:
    """One batch command; when each manifest line appeared, and what it says."""
    work = out / f"batch-{size}-{replicas}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prompts = work / "prompts.txt"
    prompts.write_text("".join(f"{PROMPTS[i % len(PROMPTS)]}, number {i}\n" for i in range(args.lines)))
    manifest = work / "images" / "manifest.jsonl"
    started = time.monotonic()
    process = _app("launch", "--nproc", str(args.gpus), "batch", str(prompts), "--out", str(work / "images"),
                   "--model", args.model, "--model-path", str(args.folder), "--size", f"{size}x{size}",
                   "--steps", str(args.steps), "--replicas", replicas, "--quiet", "--engine-cache", str(args.cache),
                   log=out / f"batch-{size}-{replicas}.log")
    seen: list[float] = []
    while process.poll() is None or len(seen) < _lines(manifest):
        count = _lines(manifest)
        seen.extend([time.monotonic() - started] * (count - len(seen)))
        if time.monotonic() - started > args.timeout:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
            break
        time.sleep(0.05)
    entries = [json.loads(line) for line in manifest.read_text().splitlines()] if manifest.exists() else []
    if manifest.exists():
        shutil.copy(manifest, out / f"batch-{size}-{replicas}-manifest.jsonl")
    shutil.rmtree(work / "images", ignore_errors=True)
    stages = {}
    for stage in ("encode_s", "step_s", "decode_s", "write_s"):
        values = [entry["stages"][stage] for entry in entries[args.gpus:] if entry.get("stages")]
        values = [sum(v) if isinstance(v, list) else v for v in values if v is not None]
        stages[stage] = round(statistics.mean(values), 4) if values else None
    skip = args.gpus
    steady = seen[skip:]
    rate = 60 * (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 and steady[-1] > steady[0] else None
    return {"size": size, "replicas": replicas, "exit": process.returncode, "images": len(entries),
            "wall_seconds": round(time.monotonic() - started, 2), "line_seconds": [round(t, 3) for t in seen],
            "images_per_minute_after_first": rate, "skipped_first": skip, "mean_stage_seconds": stages,
            "groups": sorted({entry.get("group", "") for entry in entries}),
            "plans": sorted({entry.get("plan", "") for entry in entries})}


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def gpu_memory_mib() -> list[int] | None:
    """Each GPU's memory in use (nvidia-smi's memory.used, MiB: every process on it, caching allocators included),
    or None where there is no nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(line) for line in out.split()]


def run_serve(args: argparse.Namespace, size: int, replicas: str, out: Path) -> dict:
    """A server with `replicas`; a warm-up, its GPU memory, a lone request LONE times, then `--users` users at once."""
    from gradio_client import Client

    from app.commands.launch import free_port

    port = free_port()
    log = out / f"serve-{size}-{replicas}.log"
    started = time.monotonic()
    process = _app("launch", "--nproc", str(args.gpus), "serve", "--model", args.model, "--model-path",
                   str(args.folder), "--replicas", replicas, "--port", str(port), "--max-request-seconds", "0",
                   "--max-queue", str(4 * args.users), "--engine-cache", str(args.cache), log=log)
    url = f"http://127.0.0.1:{port}/"
    try:
        while "serving on" not in log.read_text():
            if process.poll() is not None or time.monotonic() - started > args.timeout:
                raise RuntimeError(f"the server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        up = time.monotonic() - started

        def one(seed: int) -> tuple[float, dict]:
            begun = time.monotonic()
            settings = Client(url, verbose=False).predict(
                PROMPTS[seed % len(PROMPTS)], seed, False, args.steps, 3.5, size, size, api_name="/generate_image")[2]
            return time.monotonic() - begun, settings

        def together(count: int, first_seed: int) -> list[tuple[float, dict]]:
            with ThreadPoolExecutor(count) as pool:
                return list(pool.map(one, range(first_seed, first_seed + count)))

        warm = [one(0)[0], *[t for t, _ in together(args.gpus, 1)]]  # every layout the runs below use, compiled
        warm += [t for t, _ in together(args.users, 100)]
        memory = gpu_memory_mib()  # every layout the server will use, compiled and run
        lone = [one(10 + i) for i in range(LONE)]
        users = together(args.users, 200)
        latencies = [t for t, _ in users]
        return {"size": size, "replicas": replicas, "up_seconds": round(up, 1), "warm_up_seconds": warm,
                "lone_seconds": [round(t, 3) for t, _ in lone], "lone_median": statistics.median(t for t, _ in lone),
                "lone_server_seconds": [s.get("seconds") for _, s in lone],
                "lone_server_median": statistics.median(s.get("seconds") or float("nan") for _, s in lone),
                "lone_groups": [s.get("group", "") for _, s in lone],
                "users": args.users, "user_seconds": [round(t, 3) for t in latencies],
                "user_mean": statistics.mean(latencies), "user_worst": max(latencies),
                "user_groups": sorted({s.get("group", "") for _, s in users}), "gpu_memory_mib": memory}
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--folder", type=Path, required=True, help="checkpoint folder (written if missing)")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--parts", default="batch,serve")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/replicas-engine-cache"))
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds one command may take")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "replicas.json"
    results = json.loads(result_path.read_text()) if result_path.exists() else {"batch": [], "serve": []}
    if not args.folder.exists():
        started = time.monotonic()
        write_random_checkpoint(args.model, args.folder)
        results["checkpoint_seconds"] = round(time.monotonic() - started, 1)
    sizes = [int(size) for size in args.sizes.split(",")]
    parts = args.parts.split(",")
    for size in sizes if "batch" in parts else []:
        for replicas in ("1", "auto"):
            results["batch"].append(run_batch(args, size, replicas, args.out))
            result_path.write_text(json.dumps(results, indent=1))
            print(json.dumps(results["batch"][-1]), flush=True)
    for replicas in ("1", "auto") if "serve" in parts else ():
        results["serve"].append(run_serve(args, sizes[0], replicas, args.out))
        result_path.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["serve"][-1]), flush=True)


if __name__ == "__main__":
    main()

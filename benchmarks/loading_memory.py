"""Peak host memory of one rank loading its share of a transformer from safetensors
(engines/weights/sharded_loading.py), against diffusers' whole from_pretrained: a Cosmos 3 transformer of ~250M
parameters with random bf16 weights, written once to --folder. Each load runs in a fresh process (the peak resident size
is a high-water mark); the loader needs no process group, so one process per (tp, rank) shows what each rank of a real
run holds. Growth over the process before loading, after every kept parameter was read once: peak resident size,
and at the end the process's own (anonymous) memory and the pages of the memory-mapped files it touched
(safetensors maps the files: a slice along the input columns touches every page of its rows).

    python -m benchmarks.loading_memory --tp 1,2,4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 1024**2
CONFIG = dict(hidden_size=1024, head_dim=64, num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096,
              num_hidden_layers=8, vocab_size=4096, latent_channel=4, latent_patch_size=2, patch_latent_dim=16,
              rope_axes_dim=(16, 8, 8))

_CHILD = """
import json, re, sys, torch
from pathlib import Path
from diffusers import Cosmos3OmniTransformer
from pipelines.cosmos3.parallel import cosmos3_weights
from engines.weights.sharded_loading import load_split, parameter_bytes
def status():
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(key + r":\\s+(\\d+)", text).group(1)) for key in ("VmHWM", "RssAnon", "RssFile")}
folder, tp, rank = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
before = status()
if tp == 0:
    model = Cosmos3OmniTransformer.from_pretrained(folder, torch_dtype=torch.bfloat16)
else:
    model = load_split(Cosmos3OmniTransformer, folder, cosmos3_weights, tp=tp, rank=rank, dtype=torch.bfloat16,
                       device="cpu")
with torch.no_grad():
    for parameter in model.parameters():  # touch every kept byte: memory-mapped pages count once read
        parameter.sum()
after = status()
print(json.dumps(dict(parameter_bytes=parameter_bytes(model),
                      **{key + "_kib": after[key] - before[key] for key in after})))
"""


def write_checkpoint(folder: Path) -> None:
    import torch
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(0)
    model = Cosmos3OmniTransformer(**CONFIG).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")


def measure(folder: Path, tp: int, rank: int) -> dict:
    """Peak resident growth and kept parameter bytes of one load (tp 0: diffusers' from_pretrained)."""
    run = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(tp), str(rank)], capture_output=True,
                         text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tensor-parallel degrees")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ulysses-studio-loading-memory"))
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not (args.folder / "config.json").is_file():
        write_checkpoint(args.folder)
    rows = [dict(load="diffusers from_pretrained (whole)", tp=1, **measure(args.folder, 0, 0))]
    for tp in (int(t) for t in args.tp.split(",")):
        rows.append(dict(load="sharded (rank 0)", tp=tp, **measure(args.folder, tp, 0)))
    print(f"{'load':<36} {'tp':>3} {'parameters kept':>16} {'peak resident':>14} {'own memory':>11} "
          f"{'file pages':>11}")
    for row in rows:
        print(f"{row['load']:<36} {row['tp']:>3} {row['parameter_bytes'] / MIB:>12.0f} MiB "
              f"{row['VmHWM_kib'] / 1024:>10.0f} MiB {row['RssAnon_kib'] / 1024:>7.0f} MiB "
              f"{row['RssFile_kib'] / 1024:>7.0f} MiB")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The scaling sweep in one command: every model, strategy and GPU count, compiled engines.
#
#   benchmarks/scaling_sweep.sh OUT_DIR            # on a machine with 8 GPUs (runs 2, 4 and 8)
#   RANKS="2 4" benchmarks/scaling_sweep.sh OUT    # fewer GPUs
#   TINY=1 RANKS="2 4 8" benchmarks/scaling_sweep.sh OUT   # CPU smoke test with tiny configs (gloo)
#
# Each run measures its own 1-GPU baseline (rank 0 alone), then every parallel mode on N ranks,
# so every speedup is against a baseline taken in the same run. Results: OUT_DIR/N<ranks>/bench.json
# and bench.png per GPU count.
set -euo pipefail
out=${1:?usage: benchmarks/scaling_sweep.sh OUT_DIR}
ranks=${RANKS:-"2 4 8"}
backend=${BACKEND:-inductor-blocks+cudagraph}
for n in $ranks; do
    if [ -n "${TINY:-}" ]; then
        ulysses-studio bench --ranks "$n" --tiny --out "$out/N$n" -- \
            --model flux-dev,cosmos-predict2-2b-video2world --strategies ulysses,ring,allgather,ulysses-ring --warmup 1 --iters 1
    else
        ulysses-studio bench --ranks "$n" --out "$out/N$n" -- \
            --model flux-dev,cosmos-predict2-2b-video2world,cosmos-predict2-14b-video2world --sizes 1024x1024,2048x2048 --video 93x704x1280 \
            --strategies ulysses,ring,allgather,ulysses-ring --backends "$backend" --warmup 1 --iters 3
    fi
done

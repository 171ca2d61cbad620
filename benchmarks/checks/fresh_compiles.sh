#!/usr/bin/env bash
# Whether two fresh compiles of the same engine draw the same pixels, with inductor's defaults and with
# TORCHINDUCTOR_DETERMINISTIC=1: RUNS `generate` runs of one tiny-flux image each way, each into an empty engine
# cache with inductor's machine-wide folder removed, then the largest pixel difference between every two images.
#
#   benchmarks/checks/fresh_compiles.sh OUT_DIR      # on a GPU, from the repository root (RUNS=3, BACKEND=...)
#
# Measured (docs/bench/2026-11-26-h100-fresh-compiles/): 6-13 levels of 255 between fresh compiles either way,
# so the difference of a `build`-filled cache from a first launch's is not the build's doing.
set -uo pipefail
out=${1:?usage: benchmarks/checks/fresh_compiles.sh OUT_DIR}
runs=${RUNS:-3}
backend=${BACKEND:-inductor-blocks+cudagraph}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
machine_wide=$(python3 -c "from torch._inductor.runtime.cache_dir_utils import default_cache_dir; print(default_cache_dir())")
for mode in default deterministic; do
    for i in $(seq "$runs"); do
        if [ "$mode" = deterministic ]; then export TORCHINDUCTOR_DETERMINISTIC=1; else unset TORCHINDUCTOR_DETERMINISTIC; fi
        rm -rf "$machine_wide"
        t0=$(date +%s)
        python3 -m app generate --model tiny-flux --prompt "a big red star in the center on a white background" \
            --seed 7 --steps 8 --size 256x256 --backend "$backend" --engine-cache "$work/$mode-$i" \
            --out "$out/$mode-$i.png" --quiet > "$out/$mode-$i.log" 2>&1
        echo "$mode-$i: exit $?, $(($(date +%s) - t0)) s, kernels under its engine cache: $(find "$work/$mode-$i/inductor" -name '*.py' | wc -l), in $machine_wide: $(find "$machine_wide" -name '*.py' 2>/dev/null | wc -l)"
    done
done
python3 - "$out" <<'EOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image

images = {p.stem: np.asarray(Image.open(p)).astype(int) for p in sorted(Path(sys.argv[1]).glob("*.png"))}
print("largest pixel difference (of 255) between the images:")
for a in images:
    print(a, " ".join(f"{b}:{np.abs(images[a] - images[b]).max()}" for b in images))
EOF
rm -rf "$work"

#!/usr/bin/env bash
# Train several recipes of the embedded tiny models at once on a 2-GPU machine, score each on the
# held-out prompts, and keep the best tiny-flux and the best tiny-cosmos.
#
#     training/sweep.sh OUT [MINUTES]
#
# Each run is an ordinary `python -m training --only ...` command, written into its model card, so the
# kept model is reproducible on its own. OUT receives one log per run and best-tiny-flux.tar /
# best-tiny-cosmos.tar (the winners' diffusers folders, model cards included). DEVICE (default cuda)
# and EXTRA (more flags for every run) are read from the environment.
set -uo pipefail
out=${1:?usage: training/sweep.sh OUT [MINUTES]}
minutes=${2:-7}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."  # the repository root, where `python -m training` finds the package
work=$(mktemp -d)

# name -> "GPU|flags"; names start with flux- or cosmos-, which is how the results are grouped.
# One run per GPU: the runs are GPU-bound once their batches are large, so runs sharing a GPU split
# its steps (measured with three tiny-flux recipes on GPU 0 and two tiny-cosmos recipes on GPU 1 for
# 7 minutes). Add lines to compare recipes.
declare -A recipes=(
    [flux-w64]="0|--only flux --text-width 64 --vae-share 0.12 --batch-scale 2"
    [cosmos-w64]="1|--only cosmos --text-width 64 --vae-share 0.4 --batch-scale 2"
)

for name in "${!recipes[@]}"; do
    gpu=${recipes[$name]%%|*}
    flags=${recipes[$name]#*|}
    # shellcheck disable=SC2086 # flags are words
    CUDA_VISIBLE_DEVICES=$gpu python -m training --device "${DEVICE:-cuda}" --minutes "$minutes" --out "$work/$name" $flags ${EXTRA:-} \
        >"$out/log-$name.txt" 2>&1 &
done
wait

best_score() {  # best_score MODEL -> the MODEL-* run whose held-out line scores highest (sum of its percentages)
    local best="" best_total=-1
    for log in "$out"/log-"$1"-*.txt; do
        local line total
        line=$(grep -h "held-out:" "$log" | tail -1)
        [ -n "$line" ] || continue
        total=$(echo "$line" | grep -o "[0-9]*%" | tr -d % | awk "{s += \$1} END {print s}")
        echo "$(basename "$log" .txt | sed 's/^log-//'): $line" >&2
        if [ "$total" -gt "$best_total" ]; then best_total=$total; best=$(basename "$log" .txt | sed 's/^log-//'); fi
    done
    echo "$best"
}

for model in flux cosmos; do
    best=$(best_score "$model")
    if [ -n "$best" ]; then
        echo "best tiny-$model: $best"
        tar -C "$work/$best" -cf "$out/best-tiny-$model.tar" "tiny-$model"
    else
        echo "no tiny-$model run finished"
    fi
done

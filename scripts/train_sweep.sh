#!/usr/bin/env bash
# Train several recipes of the embedded tiny models at once on a 2-GPU machine, score each on the
# held-out prompts, and keep the best tiny-flux and the best tiny-cosmos.
#
#     scripts/train_sweep.sh OUT [MINUTES]
#
# Each run is an ordinary `python -m training --only ...` command, written into its model card, so the
# kept model is reproducible on its own. OUT receives one log per run and best-tiny-flux.tar /
# best-tiny-cosmos.tar (the winners' diffusers folders, model cards included).
set -uo pipefail
out=${1:?usage: scripts/train_sweep.sh OUT [MINUTES]}
minutes=${2:-7}
mkdir -p "$out"
work=$(mktemp -d)

# name -> "GPU|flags". The first sweep (three tiny-flux recipes sharing GPU 0, two tiny-cosmos recipes
# sharing GPU 1, 7 minutes) showed that sharing a GPU divides each run's steps: the runs are GPU-bound
# once their batches are large. So one run per GPU now; add lines to compare recipes.
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

best_score() {  # best_score MODEL PATTERN -> the run whose held-out line scores highest (sum of its percentages)
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

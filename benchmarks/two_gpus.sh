#!/usr/bin/env bash
# The 2-GPU figures in two commands of under 10 minutes each: regressions and the app check (part 1), the new
# models, tensor parallelism and FP8 (part 2). Every result lands in OUT_DIR, packed into PACK after each piece.
#
#   PART=1 PACK=$OUT/part1.tgz benchmarks/two_gpus.sh /tmp/part1     # on 2 GPUs, from the repository root
#   PART=2 PACK=$OUT/part2.tgz benchmarks/two_gpus.sh /tmp/part2
#   TINY=1 PART=1 benchmarks/two_gpus.sh /tmp/tiny1                  # CPU smoke test: tiny configs, 2 gloo ranks
#
# Each piece runs under `timeout`, its output in OUT_DIR/<piece>.log and its exit status and seconds in
# OUT_DIR/pieces.tsv; a piece that fails or runs out of time is logged and the next one runs. The pieces of a
# part share BUDGET seconds (default 530, leaving a 600 s command time for installing wheels and packing): a
# piece gets at most what is left, and one that would get under 45 s is skipped (logged). ONLY="a b" runs
# only those pieces, SKIP="a b" all but those. Engines compile into CACHE (default /tmp/two-gpus-cache,
# outside OUT_DIR: the pieces of a part reuse each other's kernels, nothing large is packed).
#
# Estimates on 2x H100, from docs/benchmarks.md (1 GPU FLUX.1-dev 1024² step 129 ms, 2048² 715 ms, compile
# 10-30 s a mode; Cosmos-Predict2-2B step 6.5 s; Cosmos 3 Nano call 3.0 s; FLUX.2-dev call 462 ms; FP8
# compile 90-290 s cold; the app check 260-290 s on 2x H200):
#   part 1 (~485 s): app-check 270 s with cosmos2b-step 150 s beside it | flux1-step 135 s | flux1-generation
#                    80-100 s | flux1-cached-step 100 s (runs only if time is left)
#   part 2 (~530 s): cosmos3-nano-step 190 s | flux2-dev-step 145 s | flux1-fp8-generation 160-360 s (what
#                    is left) | flux1-fp8-step 100 s (kernels from the generation's compile) and
#                    flux1-cached-step 100 s (each runs only if time is left)
# The app check runs beside the Cosmos-Predict2-2B step (3-6 s GPU-bound calls, against the tiny models'
# milliseconds of GPU work per request), which OUT_DIR/cosmos2b-note.txt records; SKIP=app-check for clean rows.
set -uo pipefail
out=${1:?usage: PART=1|2 [TINY=1] [PACK=file.tgz] benchmarks/two_gpus.sh OUT_DIR}
part=${PART:?PART=1 or PART=2}
budget=${BUDGET:-$([ -n "${TINY:-}" ] && echo 3000 || echo 530)}
cache=${CACHE:-/tmp/two-gpus-cache}
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)
start=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
printf 'piece\tstatus\tseconds\n' >> "$out/pieces.tsv"

if [ -n "${TINY:-}" ]; then
    tiny=(--tiny) backend=eager fast=eager transport=nccl
    flux_sizes=64x64 cosmos_video=9x32x48 nano_video=9x64x96 steps=(--steps 4) few=(--warmup 1 --iters 1)
else
    tiny=() backend=inductor-blocks+overlap+cudagraph fast=inductor-blocks transport=copy-engine
    flux_sizes=1024x1024,2048x2048 cosmos_video=93x704x1280 nano_video=189x720x1280 steps=(--steps 28)
    few=(--warmup 1 --iters 2)
fi
step=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.step "${tiny[@]}")
generation=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.generation "${tiny[@]}")

pack() {
    # logs beyond 4 MB keep their last 4 MB; the app check's work folder (engine caches) stays behind
    find "$out" -name '*.log' -size +4M -exec sh -c 'tail -c 4000000 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
    [ -n "${PACK:-}" ] && tar czf "$PACK.$BASHPID" --exclude=./app-check/work -C "$out" . && mv "$PACK.$BASHPID" "$PACK"
    return 0
}

wanted() {
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]] && return 1
    [[ " ${SKIP:-} " == *" $1 "* ]] && return 1
    return 0
}

# piece NAME CAP COMMAND...: COMMAND under `timeout`, at most CAP seconds and what is left of the budget
piece() {
    local name=$1 cap=$2 left t0 status
    shift 2
    wanted "$name" || return 0
    left=$((budget - ($(date +%s) - start) - 10))
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 45 ]; then
        printf '%s\tskipped: %s s left of the budget\n' "$name" "$left" | tee -a "$out/pieces.tsv"
        return 0
    fi
    echo "== $name (up to ${cap} s): $*" | tee -a "$out/commands.txt"
    t0=$(date +%s)
    timeout -k "${KILL_AFTER:-30}" "$cap" "$@" > "$out/$name.log" 2>&1
    status=$?
    [ "$status" -eq 124 ] && status="124 (timed out at ${cap} s)"
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - t0))" | tee -a "$out/pieces.tsv"
    pack
}

environment() {
    date -u; uname -a; nproc
    python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
    python3 -m pip list 2>/dev/null | grep -iE '^(torch|torchao|triton|diffusers|transformers|gradio|gradio.client|imageio.ffmpeg|accelerate) '
    git log -1 --format='commit %H %s' 2>/dev/null; git status --short 2>/dev/null | head -20
    command -v nvidia-smi > /dev/null && nvidia-smi && nvidia-smi topo -m
    return 0
}
environment > "$out/environment.txt" 2>&1
if command -v nvidia-smi > /dev/null; then  # power and clocks through the part (H200s ran at their power cap)
    nvidia-smi --query-gpu=timestamp,index,power.draw,clocks.sm,temperature.gpu,utilization.gpu,memory.used \
        --format=csv -lms 1000 > "$out/nvidia-smi.csv" 2>&1 &
    smi=$!
    trap 'kill $smi 2>/dev/null' EXIT
fi

if [ "$part" = 1 ]; then
    # the app on 2 ranks (serve through gradio_client, Ctrl-C, generate, batch, warm cache, build, the built
    # cache's image and what differs between the caches: app-check/cache_diff.json), first, so that it has
    # its whole time; beside it Cosmos-Predict2-2B, whose calls are long enough not to feel it
    if wanted app-check && python3 -c "import gradio, gradio_client" 2> /dev/null; then
        # 90 s after a SIGTERM: the check stops its servers with Ctrl-C and waits for them (they run in their
        # own sessions, which would outlive this command and hold the GPUs)
        KILL_AFTER=90 piece app-check 320 python3 -m benchmarks.checks.app_on_gpus --out "$out/app-check" --ranks 2 \
            --strategy allgather --all-to-all "$transport" --backend "$backend" &
        app=$!
        echo "measured while the app check ran beside it on the same GPUs" > "$out/cosmos2b-note.txt"
        sleep 5  # the app check's launch first
    else
        wanted app-check && printf 'app-check\tskipped: gradio or gradio_client is not installed\n' | tee -a "$out/pieces.tsv"
        app=
    fi
    # Cosmos-Predict2-2B one step at 93x704x1280: 1 GPU, ring-2 on copy engines, cfg-2
    piece cosmos2b-step 200 "${step[@]}" --model cosmos-predict2-2b-video2world --video "$cosmos_video" \
        --strategies ring --all-to-all "$transport" --backends "$backend" --warmup 1 --iters 1 \
        --cache-dir "$cache" --out "$out/cosmos2b-step.json"
    [ -n "$app" ] && wait "$app"  # the FLUX.1 rows below on GPUs that nothing else uses
    # FLUX.1-dev one step, 1024² and 2048²: 1 GPU, allgather-2 on copy engines, diffusers-native Ulysses-2
    # (docs/benchmarks.md "FLUX.1-dev and Cosmos-Predict2-2B on 2 GPUs, one step"; the goal: <= 66 ms at 1024²)
    piece flux1-step 200 "${step[@]}" --model flux-dev --sizes "$flux_sizes" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --warmup 1 --iters 5 --cache-dir "$cache" \
        --out "$out/flux1-step.json"
    # a whole FLUX.1-dev 1024² image, 28 steps, 1 GPU against allgather-2 (docs: "Whole generations on 2 GPUs";
    # its blocks' kernels come from the step piece's compile, in the same inductor cache)
    piece flux1-generation 160 "${generation[@]}" --model flux-dev "${steps[@]}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --runs 2 --warmup-steps 2 --engine-cache "$cache" \
        --out "$out/flux1-generation.json"
    # a skipped step's cost (--cache), 1 GPU and allgather-2, if time is left
    piece flux1-cached-step 150 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$fast" --cached-step --no-diffusers --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-cached-step.json"
elif [ "$part" = 2 ]; then
    # Cosmos 3 Nano, one call (a guidance branch) at its default 189x720x1280 with 300 text tokens: 1 GPU, every
    # strategy, then tp 2 (memory per rank and time; the weights are split in place, so it runs last)
    piece cosmos3-nano-step 260 "${step[@]}" --model cosmos3-nano --video "$nano_video" --text-tokens 300 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" "${few[@]}" --tp 2 --cache-dir "$cache" \
        --out "$out/cosmos3-nano-step.json"
    # FLUX.2-dev one call at 1024² with 512 text tokens: 1 GPU, every strategy, then tp 2
    piece flux2-dev-step 220 "${step[@]}" --model flux2-dev --sizes "${flux_sizes%%,*}" --text-tokens 512 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" --warmup 2 --iters 5 --tp 2 \
        --cache-dir "$cache" --out "$out/flux2-dev-step.json"
    # a whole FLUX.1-dev 1024² image with --fp8 on 2 GPUs (the goal: <= 1.5 s; step_s: each step's seconds),
    # bf16 first on the same weights; no 1 GPU rows (part 1 has them)
    piece flux1-fp8-generation 400 "${generation[@]}" --model flux-dev "${steps[@]}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 --no-single --runs 2 --warmup-steps 2 \
        --engine-cache "$cache" --out "$out/flux1-fp8-generation.json"
    # FLUX.1-dev 1024² one step with --fp8 on 2 GPUs (the goal: <= 55 ms), against bf16 in the same run
    piece flux1-fp8-step 400 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 parallel --no-diffusers --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-fp8-step.json"
    piece flux1-cached-step 150 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$fast" --cached-step --no-diffusers --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-cached-step.json"
else
    echo "PART must be 1 or 2, got $part" >&2
    exit 2
fi
printf 'total\t-\t%s\n' "$(($(date +%s) - start))" | tee -a "$out/pieces.tsv"
[ -n "${smi:-}" ] && kill "$smi" 2>/dev/null && gzip -f "$out/nvidia-smi.csv"
pack

#!/usr/bin/env bash
# The multi-GPU figures in commands of under 10 minutes each, every result in OUT_DIR, packed into PACK after
# each piece and every PACK_EVERY seconds (60) while one runs (a command cut off from outside still returns what it
# wrote).
# On 2 GPUs: the app's acceptance run (PART=accept), Cosmos-Predict2-2B and FLUX.2 (part 1), FLUX.1-dev
# regressions and FLUX.2-dev (part 2), Cosmos 3 Nano (part 3), FP8 (part 4), the generic path's models (part 5, also on GPUS=4), LoRA (part 8), cold builds (part 9),
# every family in a CUDA graph (PART=graphs), quantized attention (PART=quantized, one piece a command: ONLY=).
# On GPUS=4 or 8: the scaling sweep (PART=sweep) and what it leaves out (PART=rest).
#
#   PART=1 PACK=$OUT/part1.tgz benchmarks/multi_gpu.sh /tmp/part1     # on 2 GPUs, from the repository root
#   PART=2 PACK=$OUT/part2.tgz benchmarks/multi_gpu.sh /tmp/part2     # (3 and 4 alike)
#   GPUS=4 PART=sweep PACK=$OUT/sweep.tgz benchmarks/multi_gpu.sh /tmp/sweep4
#   GPUS=4 PART=rest PACK=$OUT/rest.tgz benchmarks/multi_gpu.sh /tmp/rest4
#   TINY=1 PART=1 benchmarks/multi_gpu.sh /tmp/tiny1                  # CPU smoke test: tiny configs, gloo ranks
#
# Each piece runs under `timeout`, its output in OUT_DIR/<piece>.log and its exit status and seconds in
# OUT_DIR/pieces.tsv; a piece that fails or runs out of time is logged and the next one runs. The pieces of a
# part share BUDGET seconds (default 530, leaving a 600 s command time for installing wheels and packing): a
# piece gets at most what is left, and one that would get under 45 s is skipped (logged). ONLY="a b" runs
# only those pieces, SKIP="a b" all but those; FLUX_SIZES=1024x1024 drops FLUX.1's 2048² rows. Engines compile into
# CACHE (default /tmp/multi-gpu-cache, outside OUT_DIR: the pieces of a part, and the parts run on one machine, reuse
# each other's kernels). CUDA_VISIBLE_DEVICES=0,1 and 2,3 run two 2-GPU parts at once on a 4-GPU host, each with a
# CACHE of its own (a copy of a warm one).
# The acceptance run needs imageio-ffmpeg (its video rows), openai (serve) and gradio with gradio_client (serve's UI
# row): on a machine that keeps /tmp between commands they can be installed into one --target by several commands,
# where together they are too big to travel in one.
#
# Measured on 2x H100 (docs/benchmarks.md, 2026-11-25), in seconds: Cosmos-2B step 141 | FLUX.1 step 128 | FLUX.1 generation 68 with the step's kernels |
# cached step 82 | Cosmos 3 Nano step 144 | FLUX.2-dev step 110 up to tp 2 | FP8 compile on 2 ranks over 278
# cold (one GPU: 294):
#   accept: accept-generate 520 | accept-batch | accept-serve (one a command: ONLY=accept-generate ...)
#   part 1 (~450 s): cosmos2b-step 200 s and flux2-generation 300 s
#   part 2 (~480 s): flux1-step 200 | flux1-generation 160 | flux1-cached-step 150 (both transports) |
#                    flux2-dev-step 220 (every strategy, tp 2 last)
#   part 3 (~400 s): cosmos3-nano-step 260 (every strategy, cached step, tp 2 last) | cosmos3-nano-generation
#                    200 (29 frames, 1 GPU and ulysses-2) | cosmos3-super-tp 107 on 2 of 4x H200 (alone: ONLY=)
#   part 4 (2x / 4x H200, 2026-11-27): flux1-fp8-generation 99 / 92 | flux1-fp8-step 54 / 57 (with the sweep's kernels)
#          | flux1-fp8-profile 64 (4 GPUs)
#   part 5 (2x H200, 2026-11-27): qwen-image-step 74 | flux3-step 69 | wan14b-step over 220
#          (its 1 GPU row alone: 113); on 4x H200, without the graph rows: 94 | 76 | - | 263
#   part 5 with its graph rows, 4x H200: qwen-image-step 91 | flux3-step 110 | qwen-image-profile 42
#   part 6 (4x H200, 2026-11-27): qwen-image-generation 119 (no graphs) | wan14b-generation 193 (2 GPUs: 200)
#   part 7 (2x H200): flux1-blockgraph-step 85 with FP8, part 5's kernels warm (4x H200: 78)
#   part 8 (2x H200): flux1-lora-step 95 with part 5's kernels | flux1-lora-fp8-step 158 (cold, 2 of 4x H200)
#   graphs (2 of 4x H200): flux2-klein-graphs 54 | wan-1.3b-graphs 89 | wan22-ti2v-graphs 82 | cosmos3-nano-graphs 110
#   part 9 (not yet timed on GPUs): cold-bf16 150 | cold-fp8-scaled-mm 200 | cold-fp8-torchao 420, each from an
#          empty cache
#   quantized (2x H200, 2026-11-30; one a command): wan14b-precisions 174 without its diffusers rows (with them not
#          yet timed) | wan14b-fp8-precisions 202 | wan14b-i2v-precisions 211 | wan14b-i2v-fp8-precisions 209 |
#          wan14b-i2v-generation 199 (needs imageio-ffmpeg) |
#          flux1-fp8-attention-generation 64 (part 4's kernels warm); a command's run limit above BUDGET + 20 s,
#          so that the pack at a piece's end comes back
#   sweep: flux1-sweep 240 | cosmos2b-sweep 200 | flux2-dev-sweep 150 | cosmos3-nano-sweep 150, each 1 GPU
#          against every strategy on GPUS ranks, in that order of priority
#   rest: flux1-ulysses-ring 240 (with xDiT) | flux2-dev-2048 200 | flux2-dev-tp 150
set -uo pipefail
out=${1:?usage: [GPUS=2|4|8] PART=accept|1|2|3|4|5|6|7|8|9|graphs|quantized|sweep|rest [TINY=1] [PACK=file.tgz] benchmarks/multi_gpu.sh OUT_DIR}
part=${PART:?PART=accept, 1, 2, 3, 4, 5, 6, 7, 8, 9, graphs, quantized, sweep or rest}
gpus=${GPUS:-2}
budget=${BUDGET:-$([ -n "${TINY:-}" ] && echo 3000 || echo 530)}
cache=${CACHE:-/tmp/multi-gpu-cache}
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)
start=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
printf 'piece\tstatus\tseconds\n' >> "$out/pieces.tsv"

if [ -n "${TINY:-}" ]; then
    tiny=(--tiny) backend=eager fast=eager graph=eager graphs=eager transport=nccl
    flux_sizes=64x64 cosmos_video=9x32x48 nano_video=9x64x96 steps=(--steps 4) few=(--warmup 1 --iters 1)
    nano_frames=9 nano_steps=(--steps 4) wan_video=9x48x64 qwen_sizes=64x64
    wan_shape=(--frames 9 --height 48 --width 64) qwen_shape=(--height 64 --width 64) qwen_steps=(--steps 4)
    wan_small=9x48x64 ti2v_video=9x64x96
else
    tiny=() backend=inductor-blocks+overlap+cudagraph fast=inductor-blocks graph=inductor-blocks+cudagraph
    graphs=$fast,$graph
    transport=copy-engine
    flux_sizes=${FLUX_SIZES:-1024x1024,2048x2048} cosmos_video=93x704x1280 nano_video=189x720x1280 steps=(--steps 28)
    few=(--warmup 1 --iters 2) nano_frames=29 nano_steps=() wan_video=81x720x1280 qwen_sizes=1328x1328
    wan_shape=(--frames 81 --height 720 --width 1280) qwen_shape=(--height 1328 --width 1328) qwen_steps=(--steps 20)
    wan_small=81x480x832 ti2v_video=49x704x1280
fi
step=(python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m benchmarks.step "${tiny[@]}")
generation=(python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m benchmarks.generation "${tiny[@]}")

pack() {
    # logs beyond 4 MB keep their last 4 MB
    find "$out" -name '*.log' -size +4M -exec sh -c 'tail -c 4000000 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
    [ -n "${PACK:-}" ] && tar czf "$PACK.$BASHPID" -C "$out" . && mv "$PACK.$BASHPID" "$PACK"
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
    timeout -k "${KILL_AFTER:-30}" "$cap" "$@" > "$out/$name.log" 2>&1 &
    local command=$! last=$t0
    # meanwhile a pack a minute: a command cut off from outside (its run limit) still returns the rows written so far
    while kill -0 "$command" 2>/dev/null; do
        sleep 1
        if [ -n "${PACK:-}" ] && [ $(($(date +%s) - last)) -ge "${PACK_EVERY:-60}" ]; then
            pack
            last=$(date +%s)
        fi
    done
    wait "$command"
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
    git status --short 2>/dev/null | head -20  # local changes (the date names the code: git keeps its history)
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

if [ "$part" = accept ]; then
    # the GPU acceptance run of the app's own commands (benchmarks/checks/acceptance.py), one of its parts a
    # command: ONLY=accept-generate (then accept-batch, accept-serve) on one machine, sharing the engine cache
    for name in generate batch serve; do
        KILL_AFTER=60 piece "accept-$name" 520 python3 -m benchmarks.checks.acceptance --part "$name" \
            --out "$out/accept-$name" --gpus "$gpus" --cache "$cache/acceptance"
    done
elif [ "$part" = 1 ]; then
    # Cosmos-Predict2-2B one step at 93x704x1280: 1 GPU, ring-2 on copy engines, cfg-2
    piece cosmos2b-step 200 "${step[@]}" --model cosmos-predict2-2b-video2world --video "$cosmos_video" \
        --strategies ring --all-to-all "$transport" --backends "$backend" --warmup 1 --iters 1 \
        --cache-dir "$cache" --out "$out/cosmos2b-step.json"
    # a whole FLUX.2 image (default FLUX.2-dev, 1024², 50 steps, its 24B text encoder on rank 0: 105 GiB there,
    # so H200s; FLUX2_MODEL=flux2-klein-9b fits H100s): 1 GPU against ulysses-2
    piece flux2-generation 300 "${generation[@]}" --model "${FLUX2_MODEL:-flux2-dev}" --strategies ulysses \
        --backends "$fast" --runs 1 --warmup-steps 1 --engine-cache "$cache" --out "$out/flux2-generation.json"
elif [ "$part" = 2 ]; then
    # FLUX.1-dev one step, 1024² and 2048²: 1 GPU, allgather-2 on copy engines, diffusers-native Ulysses-2
    # (docs/benchmarks.md "2x H100 on the current code"; the goal: <= 66 ms at 1024²)
    piece flux1-step 200 "${step[@]}" --model flux-dev --sizes "$flux_sizes" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --warmup 1 --iters 5 --cache-dir "$cache" \
        --out "$out/flux1-step.json"
    # a whole FLUX.1-dev 1024² image, 28 steps, 1 GPU against allgather-2 (its blocks' kernels come from the
    # step piece's compile, in the same inductor cache)
    piece flux1-generation 160 "${generation[@]}" --model flux-dev "${steps[@]}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --runs 2 --warmup-steps 2 --engine-cache "$cache" \
        --out "$out/flux1-generation.json"
    # a skipped step's cost (--cache), 1 GPU and allgather-2 on both transports: without CUDA graphs (the
    # cache's backend) copy engines measured slower than 1 GPU; NCCL beside them says whether the host is why
    piece flux1-cached-step 150 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "nccl,$transport" --backends "$fast" --cached-step --no-diffusers --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-cached-step.json"
    # FLUX.2-dev one call at 1024² with 512 text tokens: 1 GPU, every strategy, then tp 2 (the weights are
    # split in place, so it runs last)
    piece flux2-dev-step 220 "${step[@]}" --model flux2-dev --sizes "${flux_sizes%%,*}" --text-tokens 512 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" --warmup 2 --iters 5 --tp 2 \
        --cache-dir "$cache" --out "$out/flux2-dev-step.json"
elif [ "$part" = 3 ]; then
    # Cosmos 3 Nano, one call (a guidance branch) at its default 189x720x1280 with 300 text tokens: 1 GPU, every
    # strategy, a skipped step's cost, then tp 2 (memory per rank and time)
    piece cosmos3-nano-step 260 "${step[@]}" --model cosmos3-nano --video "$nano_video" --text-tokens 300 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" "${few[@]}" --cached-step --tp 2 \
        --cache-dir "$cache" --out "$out/cosmos3-nano-step.json"
    # a whole Cosmos 3 Nano video (29 frames, 35 steps, text encoder and VAE included): 1 GPU against ulysses-2
    piece cosmos3-nano-generation 200 "${generation[@]}" --model cosmos3-nano --frames "$nano_frames" \
        "${nano_steps[@]}" --strategies ulysses --backends "$fast" --runs 1 --warmup-steps 1 \
        --engine-cache "$cache" --out "$out/cosmos3-nano-generation.json"
    # Cosmos 3 Super (64B: ~119 GiB in bf16, more than a GPU) one call at Nano's size, tp 2 on a model built split
    # (no rank holds the whole), bf16 then --fp8 on the same weights, each rank's peak memory (ONLY=cosmos3-super-tp)
    piece cosmos3-super-tp 360 "${step[@]}" --model cosmos3-super --video "$nano_video" --text-tokens 300 \
        --strategies ulysses --no-cfg --tp 2 --tp-only --fp8 parallel --backends "$fast" "${few[@]}" \
        --cache-dir "$cache" --out "$out/cosmos3-super-tp.json"
elif [ "$part" = 4 ]; then
    # a whole FLUX.1-dev 1024² image with --fp8 on $gpus GPUs (the goals: <= 1.5 s on 2, <= 0.9 s on 4; step_s:
    # each step's seconds), 1 GPU and bf16 first on the same weights, then FP8 on 1 GPU and on $gpus
    piece flux1-fp8-generation 420 "${generation[@]}" --model flux-dev "${steps[@]}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 --runs 2 --warmup-steps 2 \
        --engine-cache "$cache" --out "$out/flux1-fp8-generation.json"
    # FLUX.1-dev 1024² one step with --fp8 on 2 GPUs (the goal: <= 55 ms), against bf16 in the same run
    piece flux1-fp8-step 200 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 parallel --no-diffusers --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-fp8-step.json"
    # where the rest of the FP8 step goes: one profiled call a row and rank (chrome trace + top ops), bf16 beside it
    piece flux1-fp8-profile 150 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 parallel --no-diffusers --warmup 1 --iters 2 \
        --cache-dir "$cache" --profile "$out/flux1-fp8-profile" --out "$out/flux1-fp8-profile.json"
elif [ "$part" = quantized ]; then
    # quantized attention (--attention-precision fp8: FlashAttention-3's FP8 forward, `pip install fa3-fwd`) on $gpus
    # GPUs, against full precision on the same weights in the same run: a Wan 2.1 14B 720p step (one call with its
    # guidance batch; Ulysses; the 1 GPU rows are too long for the same command: docs/faster.md's run them), bf16 on
    # $gpus with diffusers' Ulysses beside, then the same with fp8 attention; then (a command of its own) FP8 linears
    # alone and with fp8 attention; then a whole FLUX.1-dev 1024² image with --fp8 and fp8 attention (the goals:
    # <= 1.5 s on 2 GPUs, <= 0.9 s on 4), its 1 GPU rows skipped
    # The text-to-video model (wan14b-*), then the image-to-video one (wan14b-i2v-*: 36 input channels, and CLIP's
    # 257 image tokens beside the text in each block's cross-attention)
    for kind in "" -i2v; do
        model=wan2.1${kind:--t2v}-14b
        piece "wan14b$kind-precisions" 560 "${step[@]}" --model "$model" --video "$wan_video" --text-tokens 512 \
            --strategies ulysses --no-cfg --no-single --backends "$fast" --attention-precision fp8 --warmup 1 \
            --iters 1 --cache-dir "$cache" --out "$out/wan14b$kind-precisions.json"
        piece "wan14b$kind-fp8-precisions" 560 "${step[@]}" --model "$model" --video "$wan_video" --text-tokens 512 \
            --strategies ulysses --no-cfg --backends "$fast" --fp8 alone --attention-precision fp8 --warmup 1 \
            --iters 1 --cache-dir "$cache" --out "$out/wan14b$kind-fp8-precisions.json"
    done
    # the image-to-video clip's other stages (text, CLIP and VAE encode; decode, split over the ranks; write), 1 GPU and
    # ulysses-$gpus, and its eager bf16 step: 2 steps, eager (the step rows above give the compiled steps)
    piece wan14b-i2v-generation 330 "${generation[@]}" --model wan2.1-i2v-14b "${wan_shape[@]}" --steps 2 \
        --strategies ulysses --backends eager --split-vae on --runs 1 --warmup-steps 1 --engine-cache "$cache" \
        --out "$out/wan14b-i2v-generation.json"
    piece flux1-fp8-attention-generation 420 "${generation[@]}" --model flux-dev "${steps[@]}" --no-single \
        --strategies allgather --all-to-all "$transport" --backends "$backend" --fp8 --attention-precision fp8 \
        --runs 2 --warmup-steps 2 --engine-cache "$cache" --out "$out/flux1-fp8-attention-generation.json"
elif [ "$part" = 5 ]; then
    # the generic context-parallel path (engines/parallel/generic.py), one step each, 1 GPU against every strategy on
    # $gpus ranks and diffusers' own Ulysses on the same weights where its plan runs: Qwen-Image at 1328² (6889
    # tokens: diffusers' split needs a divisor), FLUX.3 Klein base at 1024², then Wan 2.1 14B at
    # 81x720x1280 (guidance batched: cfg-parallel too). The image models with and without a CUDA graph: without
    # one their steps are host-bound on 2 and 4 GPUs (docs/benchmarks.md)
    piece qwen-image-step 200 "${step[@]}" --model qwen-image --sizes "$qwen_sizes" --text-tokens 64 \
        --strategies ulysses,ring,allgather --backends "$graphs" "${few[@]}" --cache-dir "$cache" \
        --out "$out/qwen-image-step.json"
    piece flux3-step 160 "${step[@]}" --model flux3-klein-base --sizes "${flux_sizes%%,*}" --text-tokens 256 \
        --strategies ulysses,ring,allgather --backends "$graphs" "${few[@]}" --cache-dir "$cache" \
        --out "$out/flux3-step.json"
    # why Qwen-Image's steps without graphs are slower on N GPUs than on 1: a profiled call, 1 GPU and Ulysses
    piece qwen-image-profile 120 "${step[@]}" --model qwen-image --sizes "$qwen_sizes" --text-tokens 64 \
        --strategies ulysses --no-cfg --no-diffusers --backends "$fast" --warmup 1 --iters 1 --cache-dir "$cache" \
        --profile "$out/qwen-image-profile" --out "$out/qwen-image-profile.json"
    # last, with what is left: a 1 GPU Wan 14B step is 22 s (2x H200), its compile 46 s
    piece wan14b-step 330 "${step[@]}" --model wan2.1-t2v-14b --video "$wan_video" --text-tokens 512 \
        --strategies ulysses,ring,allgather --backends "$fast" --warmup 1 --iters 1 --cache-dir "$cache" \
        --out "$out/wan14b-step.json"
elif [ "$part" = 6 ]; then
    # whole generations on the generic path, 1 GPU against ulysses-$gpus (split VAE on): Qwen-Image 1328² (20 of
    # its 50 steps, in CUDA graphs, the GPU default; and cfg-2: its two guidance calls at once, one per half of the
    # ranks), then Wan 2.1 14B 81x720x1280 with 2 steps (a 1 GPU step is ~23 s: its 50 would not fit a command; the
    # step rows of part 5 and these stages give the whole video's time; a graph changes nothing in steps this long)
    piece qwen-image-generation 240 "${generation[@]}" --model qwen-image "${qwen_shape[@]}" "${qwen_steps[@]}" \
        --strategies ulysses --cfg --backends "$graph" --split-vae on --runs 1 --warmup-steps 2 --engine-cache "$cache" \
        --out "$out/qwen-image-generation.json"
    piece wan14b-generation 330 "${generation[@]}" --model wan2.1-t2v-14b "${wan_shape[@]}" --steps 2 \
        --strategies ulysses --backends "$fast" --split-vae on --runs 1 --warmup-steps 1 --engine-cache "$cache" \
        --out "$out/wan14b-generation.json"
elif [ "$part" = 7 ]; then
    # the step cache inside CUDA graphs (+blockgraph: a graph per compiled block, the decision between them):
    # FLUX.1-dev 1024² one step, 1 GPU and allgather-$gpus, against the whole-forward graph (part 2's backend),
    # and a skipped step's cost (the goal: <= 10% of a full step); then both backends again on FP8 weights
    piece flux1-blockgraph-step 300 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend,inductor-blocks+overlap+blockgraph" --cached-step \
        --fp8 parallel --no-diffusers --warmup 1 --iters 5 --cache-dir "$cache" --out "$out/flux1-blockgraph-step.json"
elif [ "$part" = 8 ]; then
    # FLUX.1-dev 1024² one step with a random rank-64 LoRA: 1 GPU and allgather-$gpus, no LoRA against the app's
    # unfused LoRA (and the seconds a switch takes) and the LoRA merged into the weights (and one merge's seconds)
    # (benchmarks/step.py measure_lora); then the same on FP8 weights, 1 GPU and the plans
    piece flux1-lora-step 200 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --no-diffusers --lora-rank 64 --warmup 1 --iters 5 \
        --cache-dir "$cache" --out "$out/flux1-lora-step.json"
    piece flux1-lora-fp8-step 420 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" --strategies allgather \
        --all-to-all "$transport" --backends "$backend" --fp8 --no-diffusers --lora-rank 64 --warmup 1 \
        --iters 5 --cache-dir "$cache" --out "$out/flux1-lora-fp8-step.json"
elif [ "$part" = 9 ]; then
    # cold builds: FLUX.1-dev 1024² one step on allgather-$gpus, bf16 then FP8 with each FP8 linear, each from its
    # own empty engine and kernel cache (the goal: FP8 within 2x of bf16); rows carry build_s, the graphs dynamo
    # made and the seconds of each compile phase (build_phases); recompiles are logged
    for run in bf16 fp8-scaled-mm fp8-torchao; do
        case $run in
            bf16) fp8=() cap=150 ;;
            fp8-scaled-mm) fp8=(--fp8 alone --fp8-linear scaled-mm) cap=200 ;;
            fp8-torchao) fp8=(--fp8 alone --fp8-linear torchao) cap=420 ;;
        esac
        rm -rf "$cache/cold-$run"
        TORCH_LOGS=recompiles piece "cold-$run" "$cap" "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" \
            --strategies allgather --all-to-all "$transport" --backends "$backend" "${fp8[@]}" --no-diffusers \
            --warmup 1 --iters 3 --cache-dir "$cache/cold-$run" --out "$out/cold-$run.json"
    done
elif [ "$part" = graphs ]; then
    # whether every family's step runs in one CUDA graph (the candidate GPU default) and what it gains: one step, 1 GPU
    # and ulysses-$gpus, without and with +cudagraph (FLUX.1, Cosmos-Predict2 and, in part 5, Qwen-Image and FLUX.3
    # have run with graphs)
    piece flux2-klein-graphs 120 "${step[@]}" --model flux2-klein-4b --sizes "${flux_sizes%%,*}" --text-tokens 512 \
        --strategies ulysses --no-cfg --backends "$graphs" --no-diffusers "${few[@]}" --cache-dir "$cache" \
        --out "$out/flux2-klein-graphs.json"
    piece wan-1.3b-graphs 150 "${step[@]}" --model wan2.1-t2v-1.3b --video "$wan_small" --text-tokens 512 \
        --strategies ulysses --backends "$graphs" --no-diffusers "${few[@]}" --cache-dir "$cache" \
        --out "$out/wan-1.3b-graphs.json"
    piece wan22-ti2v-graphs 150 "${step[@]}" --model wan2.2-ti2v-5b --video "$ti2v_video" --text-tokens 512 \
        --strategies ulysses --backends "$graphs" --no-diffusers "${few[@]}" --cache-dir "$cache" \
        --out "$out/wan22-ti2v-graphs.json"
    piece cosmos3-nano-graphs 150 "${step[@]}" --model cosmos3-nano --video "$nano_video" --text-tokens 300 \
        --strategies ulysses --no-cfg --backends "$graphs" --no-diffusers "${few[@]}" --cache-dir "$cache" \
        --out "$out/cosmos3-nano-graphs.json"
elif [ "$part" = sweep ]; then
    # one step, 1 GPU against every strategy on $gpus ranks (diffusers-native Ulysses beside FLUX.1; Cosmos-2B
    # with its CFG-parallel plans, cfg-2 x ulysses-N/2 among them), most wanted first
    piece flux1-sweep 240 "${step[@]}" --model flux-dev --sizes "$flux_sizes" --strategies ulysses,ring,allgather \
        --all-to-all "$transport" --backends "$backend" --warmup 1 --iters 3 --cache-dir "$cache" \
        --out "$out/flux1-sweep.json"
    piece cosmos2b-sweep 200 "${step[@]}" --model cosmos-predict2-2b-video2world --video "$cosmos_video" \
        --strategies ulysses,ring --all-to-all "$transport" --backends "$backend" --no-diffusers --warmup 1 \
        --iters 1 --cache-dir "$cache" --out "$out/cosmos2b-sweep.json"
    piece flux2-dev-sweep 150 "${step[@]}" --model flux2-dev --sizes "${flux_sizes%%,*}" --text-tokens 512 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" --no-diffusers --warmup 2 --iters 3 \
        --cache-dir "$cache" --out "$out/flux2-dev-sweep.json"
    piece cosmos3-nano-sweep 150 "${step[@]}" --model cosmos3-nano --video "$nano_video" --text-tokens 300 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" --no-diffusers "${few[@]}" \
        --cache-dir "$cache" --out "$out/cosmos3-nano-sweep.json"
elif [ "$part" = rest ]; then
    # what the sweep leaves out, on $gpus ranks: FLUX.1-dev ulysses-ring (ulysses within pairs, ring across them)
    # beside Ulysses and xDiT's Ulysses on the same weights; FLUX.2-dev at 2048²; tp $gpus for FLUX.2-dev
    piece flux1-ulysses-ring 240 "${step[@]}" --model flux-dev --sizes "${flux_sizes%%,*}" \
        --strategies ulysses,ulysses-ring --all-to-all "$transport" --backends "$backend" --no-diffusers \
        --peers xdit --warmup 1 --iters 3 --cache-dir "$cache" --out "$out/flux1-ulysses-ring.json"
    piece flux2-dev-2048 200 "${step[@]}" --model flux2-dev --sizes "${flux_sizes##*,}" --text-tokens 512 \
        --strategies ulysses,ring,allgather --no-cfg --backends "$fast" --no-diffusers --warmup 1 --iters 2 \
        --cache-dir "$cache" --out "$out/flux2-dev-2048.json"
    piece flux2-dev-tp 150 "${step[@]}" --model flux2-dev --sizes "${flux_sizes%%,*}" --text-tokens 512 \
        --strategies ulysses --no-cfg --backends "$fast" --no-diffusers --warmup 2 --iters 3 --tp "$gpus" \
        --cache-dir "$cache" --out "$out/flux2-dev-tp.json"
else
    echo "PART must be 1, 2, 3, 4, 5, 6, 7, 8, 9, graphs, quantized, sweep or rest, got $part" >&2
    exit 2
fi
printf 'total\t-\t%s\n' "$(($(date +%s) - start))" | tee -a "$out/pieces.tsv"
[ -n "${smi:-}" ] && kill "$smi" 2>/dev/null && gzip -f "$out/nvidia-smi.csv"
pack

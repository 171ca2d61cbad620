"""Where --fp8's time goes on FLUX.1-dev's shapes (CUDA): its GEMMs alone, then one single-stream block.

    python -m benchmarks.fp8_block        # one GPU, random bf16 weights, about 2 minutes (one FP8 compile)

Prints, for the block's GEMM shapes at 1024² (4,608 tokens; q/k/v apart and fused): bf16 matmul against
torch._scaled_mm with per-row and per-tensor scales (the ceiling FP8 can reach), and one eager per-row
quantization of the activation; then one FluxSingleTransformerBlock in bf16 and with per-row FP8 linears
(engines.levers.fp8.quantize_fp8: the app's recipe, q/k/v fused), eager and compiled, with CUDA kernel tables. A
compiled FP8 block whose kernels add up to less GPU time than its wall time is bound by the host (per call: the
Python of the compiled wrapper and the launches; with torchao's tensor-subclass weights, once the app's form, also
their unwrapping).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

TOKENS, WIDTH, HEADS = 4608, 3072, 24  # FLUX.1-dev at 1024²: 512 text + 4,096 image tokens
GEMMS = ((3072, 3072), (3072, 9216), (3072, 12288), (15360, 3072))  # (K, N): q/k/v apart, fused, proj_mlp, proj_out


def median_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Median CUDA-event time of fn() after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemms() -> None:
    """bf16 against FP8 GEMMs on the block's shapes, and the cost of quantizing an activation eagerly."""
    for k, n in GEMMS:
        _gemm(k, n)


def _gemm(k: int, n: int) -> None:
    """gemms' row for one (K, N) shape."""
    dtype, fp8 = torch.bfloat16, torch.float8_e4m3fn
    x, w = torch.randn(TOKENS, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype)
    x8, w8 = x.to(fp8), w.to(fp8)
    rows, cols = torch.ones(TOKENS, 1, device="cuda"), torch.ones(1, n, device="cuda")
    one = torch.ones((), device="cuda")
    bf16 = median_ms(lambda: x @ w.t())
    per_row = median_ms(lambda: torch._scaled_mm(x8, w8.t(), scale_a=rows, scale_b=cols, out_dtype=dtype,
                                                 use_fast_accum=True))
    per_tensor = median_ms(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=dtype,
                                                    use_fast_accum=True))
    quantize = median_ms(lambda: (x / (x.abs().amax(dim=1, keepdim=True).float() / 448.0)).to(fp8))
    tflop = 2 * TOKENS * k * n / 1e12
    print(f"GEMM {TOKENS}x{k}x{n}: bf16 {bf16:.3f} ms ({tflop / bf16 * 1e3:.0f} TF/s), fp8 row {per_row:.3f} ms "
          f"({tflop / per_row * 1e3:.0f}), fp8 tensor {per_tensor:.3f} ms ({tflop / per_tensor * 1e3:.0f}); "
          f"eager per-row quant of x {quantize:.3f} ms", flush=True)


def kernel_table(fn: Callable[[], object]) -> str:
    """CUDA kernels of three calls of fn, by total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=100)


def single_block() -> None:
    """One FluxSingleTransformerBlock: bf16 eager and compiled, FP8 (per row) eager and compiled."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    from engines.levers.fp8 import quantize_fp8

    dtype, generator = torch.bfloat16, torch.Generator("cuda").manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4096, WIDTH, device="cuda", dtype=dtype, generator=generator),
                  encoder_hidden_states=torch.randn(1, 512, WIDTH, device="cuda", dtype=dtype, generator=generator),
                  temb=torch.randn(1, WIDTH, device="cuda", dtype=dtype, generator=generator),
                  image_rotary_emb=(torch.randn(TOKENS, 128, device="cuda"), torch.randn(TOKENS, 128, device="cuda")))
    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(dim=WIDTH, num_attention_heads=HEADS, attention_head_dim=128).to("cuda", dtype)
    with torch.no_grad():
        compiled = torch.compile(block, fullgraph=True, dynamic=False)
        bf16_eager, bf16_compiled = median_ms(lambda: block(**inputs)), median_ms(lambda: compiled(**inputs))
        torch._dynamo.reset()
        quantize_fp8(torch.nn.ModuleDict({"blocks": torch.nn.ModuleList([block])}), ("blocks",))
        fp8_eager = median_ms(lambda: block(**inputs))
        print(f"single block eager: bf16 {bf16_eager:.2f} ms, fp8 per-row {fp8_eager:.2f} ms", flush=True)
        print(kernel_table(lambda: block(**inputs)), flush=True)
        compiled = torch.compile(block, fullgraph=True, dynamic=False)
        start = time.perf_counter()
        compiled(**inputs)
        torch.cuda.synchronize()
        print(f"fp8 single block compile {time.perf_counter() - start:.0f} s", flush=True)
        fp8_compiled = median_ms(lambda: compiled(**inputs))
        print(f"single block compiled: bf16 {bf16_compiled:.2f} ms, fp8 per-row {fp8_compiled:.2f} ms", flush=True)
        print(kernel_table(lambda: compiled(**inputs)), flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.fp8_block measures CUDA kernels: run it on a GPU")
    gemms()
    single_block()


if __name__ == "__main__":
    main()

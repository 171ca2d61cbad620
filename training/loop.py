"""The optimisation loop every training phase shares: a wall-clock budget, AdamW, warm-up and cosine decay.

A phase ends when its seconds run out (or at max_steps, for reproducible and test runs). Its learning
rate decays with the fraction of the budget used, so a slow machine takes fewer steps but still
finishes at a low learning rate. Exponential moving averages of the weights are what gets saved.

Under torchrun (a process group initialised by training/__main__.py) each rank draws its own batches and
the ranks average their gradients every step (data parallelism), so every rank holds the same weights;
every SYNC_EVERY steps they agree on the budget used (the largest share of any rank), so they take the
same learning rates and stop at the same step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

SYNC_EVERY = 10
"""Steps between the ranks' agreements on the budget used (reading it waits for the GPU: not every step)."""


def world_size() -> int:
    """Ranks training together (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this process prints the log and writes the results (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average `params`' gradients over the ranks in one all-reduce.

    What DistributedDataParallel does, without wrapping each phase's forward calls (a phase calls several
    models, some inside helpers): the tiny models' gradients (1-3 M values) make one bucket anyway.
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for param, grad in zip(params, grads):
        param.grad = flat[offset: offset + grad.numel()].view_as(grad)
        offset += grad.numel()


def _shared_progress(progress: float, device: torch.device) -> float:
    """The largest `progress` of any rank."""
    value = torch.tensor([progress], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


@dataclass(kw_only=True, slots=True)
class PhaseResult:
    """What one phase did, for the log and the model card."""

    name: str
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    """Mean loss over the last tenth of the steps."""
    samples: int
    """Samples seen by all ranks together."""


class Ema:
    """Exponential moving average of a module's parameters (decay ramps up over the first steps)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.module = module
        self.decay = decay
        self.shadow = [p.detach().clone().float() for p in module.parameters()]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for shadow, param in zip(self.shadow, self.module.parameters()):
            shadow.lerp_(param.detach().float(), 1 - decay)

    @torch.no_grad()
    def copy_to_module(self) -> None:
        for shadow, param in zip(self.shadow, self.module.parameters()):
            param.copy_(shadow.to(param.dtype))


def use_tf32(device: torch.device) -> None:
    """Float32 weights with TF32 matmuls and convolutions on CUDA, and cuDNN's autotuner (every phase
    repeats one batch shape). Mixed precision is opt-in per phase (run_phase's bf16): bfloat16 autocast
    on an H100 (torch 2.11+cu130, 2026-11-22) failed in the tiny-flux DiT's backward with
    CUBLAS_STATUS_EXECUTION_FAILED, so tiny-flux trains in float32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def run_phase(
    name: str,
    step: Callable[[], torch.Tensor],
    modules: list[torch.nn.Module],
    *,
    seconds: float,
    max_steps: int | None,
    lr: float,
    batch: int,
    warmup: int = 100,
    ema_decay: float | None = None,
    log_every: int = 50,
    bf16: bool = False,
) -> PhaseResult:
    """Minimise `step()`'s loss over `modules`' parameters until `seconds` pass or `max_steps` are done
    (`step()` under bfloat16 autocast if `bf16`; the parameters stay float32)."""
    if max_steps is not None:
        warmup = min(warmup, max(1, max_steps // 5))
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    emas = [Ema(m, ema_decay) for m in modules] if ema_decay else []
    for module in modules:
        module.train()
    device = params[0].device
    ranks = world_size()
    losses: list[float] = []
    start = time.perf_counter()
    steps = 0
    spent = 0.0
    while True:
        if ranks == 1 or steps % SYNC_EVERY == 0:
            spent = (time.perf_counter() - start) / seconds if seconds > 0 else 1.0
            if ranks > 1:
                spent = _shared_progress(spent, device)
        progress = spent
        if max_steps is not None:
            progress = max(spent, steps / max_steps) if seconds > 0 else steps / max_steps
        if progress >= 1.0 and steps > 0:
            break
        # Warm-up by steps, then cosine decay to a tenth by the share of the budget used.
        scale = min(1.0, (steps + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = step()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if ranks > 1:
            average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        for ema in emas:
            ema.update()
        steps += 1
        if steps == 1 or steps % 5 == 0:  # reading the loss waits for the GPU: not every step
            losses.append(float(loss.detach()))
        if is_main() and (steps == 1 or steps % log_every == 0):
            rate = steps / max(time.perf_counter() - start, 1e-9)
            print(f"[{name}] step {steps} loss {losses[-1]:.4f} lr {lr * scale:.2e} {rate:.1f} steps/s "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    for ema in emas:
        ema.copy_to_module()
    for module in modules:
        module.eval()
    tail = losses[-max(1, len(losses) // 10):]
    result = PhaseResult(name=name, steps=steps, seconds=time.perf_counter() - start, first_loss=losses[0],
                         last_loss=sum(tail) / len(tail), samples=steps * batch * ranks)
    if is_main():
        print(f"[{name}] done: {result.steps} steps in {result.seconds:.0f}s, loss {result.first_loss:.4f} -> "
              f"{result.last_loss:.4f}" + (f" (rank 0's batches; {ranks} ranks)" if ranks > 1 else ""), flush=True)
    return result


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    """`module` in eval mode with gradients off (returned for chaining)."""
    return module.eval().requires_grad_(False)


def frozen_on(parts: dict, device: torch.device) -> None:
    """Every module of a model's `parts` frozen and moved to `device`, with TF32 there (use_tf32): the start of a
    training run, whose phases then unfreeze what they train."""
    use_tf32(device)
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            frozen(part).to(device)


class TokenCache:
    """Token ids and attention masks per caption, computed once.

    Captions repeat (a few thousand distinct ones), and tokenizing a batch on the CPU costs more than a
    tiny model's training step on a GPU.
    """

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, captions: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), [B, max_length] each, on `device`."""
        missing = list(dict.fromkeys(c for c in captions if c not in self.rows))
        if missing:
            inputs = self.tokenizer(missing, padding="max_length", max_length=self.max_length, truncation=True,
                                    return_tensors="pt")
            for caption, ids, mask in zip(missing, inputs.input_ids, inputs.attention_mask):
                self.rows[caption] = (ids, mask)
        ids = torch.stack([self.rows[c][0] for c in captions]).to(device)
        mask = torch.stack([self.rows[c][1] for c in captions]).to(device)
        return ids, mask


POOL_SHARE = 0.25
"""At most this share of a transformer phase's budget goes to encoding its latent pool."""


class LatentPool:
    """Scenes encoded once by the frozen VAE; a transformer phase draws its batches from here.

    Encoding a batch through the VAE costs about as much as the transformer's whole training step,
    so encoding every batch afresh halves the steps a budget buys. The pool is large next to what a
    phase can memorise (tens of thousands of scenes, each seen with fresh noise and time every visit).
    """

    def __init__(self, make: Callable[[], tuple[list[str], torch.Tensor]], batches: int, max_seconds: float) -> None:
        """`make()` returns one batch: (captions, latents [B, ...]); it is called `batches` times, or fewer
        (at least once) when that would take more than `max_seconds`."""
        captions: list[str] = []
        latents = []
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(batches):
                if latents and time.perf_counter() - start > max_seconds:
                    break
                batch_captions, batch_latents = make()
                captions += batch_captions
                latents.append(batch_latents)
        self.captions = captions
        self.latents = torch.cat(latents)
        self.seconds = time.perf_counter() - start

    def __len__(self) -> int:
        return len(self.captions)

    def sample(self, batch: int, generator: torch.Generator) -> tuple[list[str], torch.Tensor]:
        """`batch` random entries: (captions, latents)."""
        index = torch.randint(len(self.captions), (batch,), generator=generator)
        return [self.captions[i] for i in index.tolist()], self.latents[index.to(self.latents.device)]

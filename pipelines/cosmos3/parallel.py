"""Context parallelism for diffusers' Cosmos3OmniTransformer (Cosmos 3), through the model's own seams.

Cosmos 3 packs two token streams into one sequence: the prompt's text ("und", a causal stream) and
the vision tokens ("gen"). Each layer has separate weights per stream; und tokens attend causally
to und tokens, gen tokens attend to every und and gen token; the queries have more heads than the
keys and values (grouped-query attention: Nano 32 and 8). There is no batch: one sequence per call,
and classifier-free guidance makes two calls with different text (so different lengths).

The model calls `_cp_shard_fn(und, gen, rotary)` before its layers and `_cp_gather_fn(und, gen)`
after its final norms; this adapter sets both on the model instance and installs its own attention
processor, so the model's code stays diffusers'. (diffusers' declarative context parallelism does
not cover this packed, ragged, two-stream structure; its docstring says so.)

The split:
- gen (tens of thousands of tokens at 720p) is sharded like every sequence here: padded to a
  multiple of the sequence degree (engines.parallel.sharding), padded keys left out of the softmax.
- und (a few hundred text tokens) is replicated: every rank runs its layers and its causal
  attention whole, without communication, and serves its K/V to the gen queries locally. That
  costs every rank the text stream's compute (189 frames at 720p are about 44,000 gen tokens; 300
  text tokens add about 5% to each of 8 ranks' 5,500), and saves a causal ring and a second
  exchange per layer.
- The gen stream's attention is engines.parallel.attention's split_attention, as for every model, with the
  und keys/values as its replicated `extra_kv` and the K/V heads as they are (grouped-query):
  Ulysses: one all-to-all carries this shard's gen q, k and v to head shards. When the Ulysses
  degree does not divide the K/V heads (8 ranks of a model with fewer than 8 K/V heads, or 3
  ranks of one with 8), each K/V head is repeated r = lcm(kv, ulysses) / kv times before the
  all-to-all (attention.kv_repeat), so every rank holds whole K/V heads for its query heads.
  Exact: a repeated head is the same keys.
  Ring / allgather: gen K/V travel over the K/V axis as for the other models, with their K/V
  heads only (widened to the query heads on arrival); the replicated und keys are one more block,
  merged by log-sum-exp (ring) or concatenated (allgather; over the group's collectives also when
  the run's transport is copy-engine, whose K/V gather takes no replicated keys).
- CFG: `forward_guided` (engines.parallel.wrapper) runs the conditional and unconditional calls on different
  rank groups at once and exchanges the predictions.
- Compiled engines: the text stream's length changes with every prompt, so the shard seam marks it
  dynamic (also on one rank, where nothing is sharded): blocks compiled per layer take it as a
  symbolic size instead of compiling again for each prompt length.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_cosmos3 import (
    Cosmos3OmniTransformer,
    _rotate_half,
)

from engines.parallel.attention import split_attention
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout, gather_tokens, shard_tokens
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads, split_over_mesh
from engines.parallel.wrapper import ParallelTransformer, replace_processors

GEN = 0  # the only sharded segment: the generation stream


class Cosmos3Rotary(NamedTuple):
    """Rotary cos/sin of the whole und stream and of this rank's gen shard, with the gen layout."""

    und: tuple[torch.Tensor, torch.Tensor]
    gen: tuple[torch.Tensor, torch.Tensor]
    layout: ShardLayout


def _rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (t.unsqueeze(1) for t in cos_sin)
    return x * cos + _rotate_half(x) * sin


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
    """Attention of SHD q over SHD k/v (fewer K/V heads allowed): SHD, as diffusers' native backend."""
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                         is_causal=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class Cosmos3ContextParallelProcessor:
    """Cosmos3AttnProcessor (diffusers 0.42) with the gen stream's attention made context-parallel."""

    def __init__(self, mesh: ParallelMesh) -> None:
        self.attention = split_attention(mesh)

    def __call__(
        self, attn: Any, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: Cosmos3Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(rotary_emb, Cosmos3Rotary):
            raise RuntimeError("this Cosmos 3 model is parallelized: call the module returned by parallelize_cosmos3")
        heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        # --- projections, norms and rotary, as diffusers' processor ---
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, dim))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, dim))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, dim)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, dim))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, dim))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, dim)
        q_und, k_und, k_und_for_gen = (_rope(t, rotary_emb.und) for t in (q_und, k_und, k_und_for_gen))
        q_gen, k_gen = (_rope(t, rotary_emb.gen) for t in (q_gen, k_gen))

        causal_out = _sdpa(q_und, k_und, v_und, causal=True)  # whole und stream, on every rank
        # gen queries over every gen key (sharded) and every und key (replicated): SHD seen as BSHD, B = 1
        full_out = self.attention(q_gen.unsqueeze(0), k_gen.unsqueeze(0), v_gen.unsqueeze(0), layout=rotary_emb.layout,
                                  extra_kv=(k_und_for_gen.unsqueeze(0), v_und.unsqueeze(0))).squeeze(0)
        return attn.to_out(causal_out.flatten(-2, -1)), attn.to_add_out(full_out.flatten(-2, -1))


class ParallelCosmos3(ParallelTransformer):
    """Cosmos3OmniTransformer across ranks; called like the model, full output on every rank."""

    def __init__(self, model: Cosmos3OmniTransformer, mesh: ParallelMesh, replaced: list) -> None:
        super().__init__(model, mesh, replaced)
        self._gen_length = 0
        model._cp_shard_fn = self._shard
        model._cp_gather_fn = self._gather

    def _shard(self, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: tuple) -> tuple:
        mesh = self.mesh
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        if not torch.compiler.is_compiling() and und_seq.shape[0] > 1:
            # The prompt's token count varies by request: blocks compiled per layer (engines.levers.compile) take
            # it as a symbolic size, so a new prompt length does not compile the layers again.
            for tensor in (und_seq, cos_und, sin_und):
                torch._dynamo.mark_dynamic(tensor, 0)
        if mesh.plan.seq_degree == 1:
            return und_seq, gen_seq, rotary_emb
        self._gen_length = gen_seq.shape[0]
        layout = ShardLayout(lengths=(self._gen_length,), degree=mesh.plan.seq_degree)
        self.real_tokens = (0, layout.valid(GEN, mesh.seq_rank))

        def shard(x: torch.Tensor) -> torch.Tensor:
            return shard_tokens(x, layout, segment=GEN, shard=mesh.seq_rank, dim=0)

        return und_seq, shard(gen_seq), Cosmos3Rotary((cos_und, sin_und), (shard(cos_gen), shard(sin_gen)), layout)

    def _gather(self, und_out: torch.Tensor, gen_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mesh.plan.seq_degree == 1:
            return und_out, gen_out
        return und_out, gather_tokens(gen_out, self.mesh, length=self._gen_length, dim=0)

    def forward(self, **kwargs: Any) -> Any:
        """One call of the model (its keyword arguments and result), split over the sequence ranks.
        Every rank of a CFG group gives the same arguments; guidance's calls go through forward_guided."""
        return self.model(**kwargs)

    def restore(self) -> torch.nn.Module:
        for seam in ("_cp_shard_fn", "_cp_gather_fn"):
            self.model.__dict__.pop(seam, None)
        return super().restore()


def cosmos3_weights(model: Cosmos3OmniTransformer, tp: int) -> WeightSplit:
    """Cosmos 3's tensor-parallel split (engines.parallel.tensor_parallel): per layer and for both streams (und and
    gen weights), q/k/v and the MLP's gate and up projections column-parallel, the attention outputs and the
    MLP's down projection row-parallel. The K/V heads are split like the query heads where tp divides them;
    where tp is a multiple of them, each K/V head is kept by the tp / kv ranks whose query heads read it.
    The processors read the head counts from the attention module: each rank's are set there."""
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tp degree {tp} neither divides nor is a multiple of the model's {kv_heads} K/V heads")
    key_value = LinearSplit(style="column", replicas=max(tp // kv_heads, 1))
    local_kv = max(kv_heads // tp, 1)
    linears: dict[str, LinearSplit] = {}
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}"
        linears |= {f"{prefix}.self_attn.{name}": COLUMN for name in ("to_q", "add_q_proj")}
        linears |= {f"{prefix}.self_attn.{name}": key_value for name in ("to_k", "to_v", "add_k_proj", "add_v_proj")}
        linears |= {f"{prefix}.self_attn.{name}": ROW for name in ("to_out", "to_add_out")}
        for mlp in ("mlp", "mlp_moe_gen"):
            gate = ("gate_proj",) if getattr(layer, mlp).hidden_act == "silu" else ()
            linears |= {f"{prefix}.{mlp}.{name}": COLUMN for name in (*gate, "up_proj")}
            linears[f"{prefix}.{mlp}.down_proj"] = ROW
    counts = {"num_attention_heads": local_heads(heads, tp), "num_key_value_heads": local_kv,
              "num_key_value_groups": heads // tp // local_kv}
    return WeightSplit(linears=linears, head_counts={f"layers.{i}.self_attn": counts for i in range(len(model.layers))})


def parallelize_cosmos3(model: Cosmos3OmniTransformer, mesh: ParallelMesh) -> ParallelCosmos3:
    """Shard Cosmos 3's gen stream over the mesh's sequence ranks (and its guidance calls over CFG groups),
    and its layer weights over the tp ranks (not undone by restore())."""
    mesh.plan.check(num_heads=model.config.num_attention_heads)
    split_over_mesh(model, cosmos3_weights, mesh)
    replaced = []
    if mesh.plan.seq_degree > 1:
        replaced = replace_processors([layer.self_attn for layer in model.layers],
                                      Cosmos3ContextParallelProcessor(mesh))
    return ParallelCosmos3(model, mesh, replaced)

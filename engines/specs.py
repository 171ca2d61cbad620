"""Named transformer architectures (real and tiny) and fast construction with random weights.

The real configs are the published diffusers configs: FLUX.1-dev's transformer, and the
Cosmos-Predict2 Video2World transformers as written by diffusers' convert_cosmos_to_diffusers.py
("Cosmos-2.0-Diffusion-2B/14B-Video2World"). Tiny configs keep the same code paths on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import CosmosTransformer3DModel, FluxTransformer2DModel
from torch import nn


@dataclass(kw_only=True, frozen=True, slots=True)
class TransformerSpec:
    """One named DiT architecture."""

    name: str
    family: str
    """"flux" or "cosmos": which input builder and parallelizer apply."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the diffusers model class."""

    @property
    def model_class(self) -> type[nn.Module]:
        """The diffusers class that `config` configures."""
        return FluxTransformer2DModel if self.family == "flux" else CosmosTransformer3DModel


_COSMOS_PREDICT2_COMMON = dict(
    in_channels=16 + 1,  # latent channels + the Video2World condition-mask channel
    out_channels=16,
    attention_head_dim=128,
    mlp_ratio=4.0,
    text_embed_dim=1024,
    adaln_lora_dim=256,
    max_size=(128, 240, 240),
    patch_size=(1, 2, 2),
    concat_padding_mask=True,
    extra_pos_embed_type=None,
)

SPECS: dict[str, TransformerSpec] = {
    spec.name: spec
    for spec in (
        TransformerSpec(
            name="flux-dev",
            family="flux",
            config=dict(
                patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56),
            ),
        ),
        TransformerSpec(
            name="cosmos-2b",
            family="cosmos",
            config=dict(_COSMOS_PREDICT2_COMMON, num_attention_heads=16, num_layers=28, rope_scale=(1.0, 3.0, 3.0)),
        ),
        TransformerSpec(
            name="cosmos-14b",
            family="cosmos",
            config=dict(
                _COSMOS_PREDICT2_COMMON, num_attention_heads=40, num_layers=36, rope_scale=(20 / 24, 2.0, 2.0)
            ),
        ),
        TransformerSpec(
            name="flux-tiny",
            family="flux",
            config=dict(
                patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=6, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                axes_dims_rope=(4, 6, 6),
            ),
        ),
        TransformerSpec(
            name="cosmos-tiny",
            family="cosmos",
            config=dict(
                in_channels=4 + 1, out_channels=4, num_attention_heads=6, attention_head_dim=12, num_layers=2,
                mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8, max_size=(16, 32, 32), patch_size=(1, 2, 2),
                concat_padding_mask=True, extra_pos_embed_type=None, rope_scale=(1.0, 3.0, 3.0),
            ),
        ),
    )
}


def build_random(spec: TransformerSpec, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Build `spec` directly on `device` in `dtype` with random weights (same seed -> same weights).

    The model is created on the meta device and materialised uninitialised, then filled in place:
    a 12B model never exists in float32, and no nn.init pass runs (slow for 12B on a CPU).
    """
    with torch.device("meta"):
        model = spec.model_class(**spec.config)
    # nn.Module.to, not diffusers' override: its fp32-module warning is about checkpoints, moot here.
    model = nn.Module.to(model, dtype=dtype).to_empty(device=device)
    if any(True for _ in model.buffers()):
        raise RuntimeError(f"{spec.name} has buffers, which random init would leave uninitialised")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:  # norm scales
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval().requires_grad_(False)

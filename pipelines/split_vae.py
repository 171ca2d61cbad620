"""VAE decode split over ranks: each rank decodes a band of the image's rows, rank 0 gathers the bands.

Why rows, and why the result is the one-rank decode's:
- The decoders served here (diffusers' `Decoder` of AutoencoderKL and AutoencoderKLFlux2: FLUX.1, FLUX.2;
  `WanDecoder3d` of AutoencoderKLWan: Cosmos-Predict2's Wan 2.1 VAE, Cosmos 3's Wan 2.2 VAE) have one
  global operation, the mid-block's self-attention over a whole frame. It runs at latent resolution,
  where it is cheap, so every part runs conv_in and the mid-block on the whole latent.
- Everything after it (the up blocks and the output head) is convolutions, nearest upsampling and norms.
  A convolution reaches a fixed number of rows, so a band that carries a halo of as many rows as the
  remaining layers reach computes the rows it owns exactly (its wrong edge rows never reach them); the
  band is trimmed after each block to what the layers after it still reach (`halos`).
- AutoencoderKL's GroupNorm takes its statistics over the whole image: each part sums over the rows it
  owns and the parts add their sums (an all-reduce over the ranks), so every band is normalised with the
  whole image's mean and variance. Wan's RMS norms are per position and need nothing.
- Wan decodes latent frame after latent frame with causal caches; each part keeps the caches of its
  own band, which is all its convolutions read.
So the split decode equals the whole decode up to floating-point summation order
(tests/test_split_vae.py holds it to one 8-bit level at 2, 3 and 4 ranks).

The Wan 2.1 encoder (Cosmos-Predict2's input video or image) splits the same way (`encode_wan`): its
down path by bands of input rows whose halos cover what the convolutions and stride-2 downsamplers
reach, the bands gathered on every rank at latent resolution, the mid-block and head on the whole.

The parts run one per rank of a process group (`Parts.ranks`), or all in this process one after the
other (`Parts.local`: the benchmark's measure of one part's time on one device).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MIN_ROWS_PER_PART = 2
"""A part owns at least this many latent rows (a finer split would be all halo): fewer rows than
MIN_ROWS_PER_PART x ranks are decoded whole, on rank 0 (splits)."""


@dataclass(kw_only=True)
class Parts:
    """How one decode is split: `count` bands of rows, of which this process runs `mine`."""

    count: int
    mine: tuple[int, ...]
    group: Any = None
    """The process group whose ranks run one part each (rank i: part i); None: every part runs here."""
    device: torch.device | None = None
    """Where `seconds` is measured (synchronised), or None: nothing is timed."""
    seconds: dict[int, float] = field(default_factory=dict)
    """Per part, its compute seconds (the shared trunk counted in each): filled when `device` is set."""

    @classmethod
    def ranks(cls, group: Any) -> Parts:
        """One part per rank of `group` (rank i runs part i)."""
        return cls(count=dist.get_world_size(group), mine=(dist.get_rank(group),), group=group)

    @classmethod
    def local(cls, count: int, device: torch.device | None = None) -> Parts:
        """All `count` parts in this process, one after the other; with `device`, each part's time measured."""
        return cls(count=count, mine=tuple(range(count)), device=device)

    def total(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The sum of every part's `values` (this process's parts, then over the ranks)."""
        summed = torch.stack(values).sum(0)
        if self.group is not None:
            dist.all_reduce(summed, group=self.group)
        return summed

    @contextmanager
    def clock(self, parts: tuple[int, ...]) -> Iterator[None]:
        """Add the enclosed work's seconds to each of `parts` (only when timing)."""
        if self.device is None:
            yield
            return
        _sync(self.device)
        start = time.perf_counter()
        yield
        _sync(self.device)
        for part in parts:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start

    def gather_rows(self, pieces: dict[int, torch.Tensor], sizes: list[int], everywhere: bool = False
                    ) -> torch.Tensor | None:
        """The parts' row pieces (dim -2; part p has sizes[p] rows) joined in part order: on the root (rank 0),
        None elsewhere, or with `everywhere` on every rank. Across ranks each piece travels padded to the
        largest (the collectives take equal shapes)."""
        if self.group is None:
            return torch.cat([pieces[p] for p in range(self.count)], dim=-2)
        (piece,) = pieces.values()
        padded = piece.new_zeros(*piece.shape[:-2], max(sizes), piece.shape[-1])
        padded[..., : piece.shape[-2], :] = piece
        root = everywhere or dist.get_rank(self.group) == 0
        gathered = [torch.empty_like(padded) for _ in range(self.count)] if root else None
        if everywhere:
            dist.all_gather(gathered, padded, group=self.group)
        else:
            dist.gather(padded, gathered, group_dst=0, group=self.group)
        if not root:
            return None
        return torch.cat([gathered[p][..., : sizes[p], :] for p in range(self.count)], dim=-2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def split_rows(rows: int, count: int) -> list[tuple[int, int]]:
    """`rows` cut into `count` consecutive bands whose sizes differ by at most one (the first ones larger)."""
    if count < 1 or rows < count:
        raise ValueError(f"cannot split {rows} rows into {count} parts")
    base, extra = divmod(rows, count)
    bands, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        bands.append((start, stop))
        start = stop
    return bands


def splits(latent_rows: int, ranks: int) -> bool:
    """Whether a decode of `latent_rows` latent rows is split over `ranks` ranks (else rank 0 decodes it whole)."""
    return ranks > 1 and latent_rows >= MIN_ROWS_PER_PART * ranks


# --- geometry -------------------------------------------------------------------------------------


def _reach(module: nn.Module | None) -> int:
    """Rows a module's convolutions reach beyond a row, added up (each k-row kernel reaches (k-1)/2)."""
    if module is None:
        return 0
    return sum((m.kernel_size[-2] - 1) // 2 for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d)))


def _upsampler(block: nn.Module) -> nn.Module | None:
    """The block's spatial upsampler (AutoencoderKL and WanUpBlock: `upsamplers`; WanResidualUpBlock: `upsampler`)."""
    ups = getattr(block, "upsamplers", None)
    if ups is not None:
        return ups
    return getattr(block, "upsampler", None)


def halos(blocks: list[nn.Module], head: list[nn.Module]) -> list[int]:
    """Halo rows a band needs at the input of each block, and (last) at the input of the head, each in rows
    of that point's resolution: what the layers from there on reach, a 2x upsampling halving it."""
    need = sum(_reach(m) for m in head)
    out = [need]
    for block in reversed(blocks):
        if _upsampler(block) is not None:
            need = math.ceil((need + _reach(_upsampler(block))) / 2)
        need += _reach(block.resnets)
        out.append(need)
    return out[::-1]


@dataclass
class Band:
    """The rows one part owns and the rows its tensor holds (own plus halo), at the current resolution."""

    own: tuple[int, int]
    have: tuple[int, int]
    rows: int
    """Rows of the whole image at the current resolution."""

    def up(self, factor: int) -> Band:
        return Band(own=(self.own[0] * factor, self.own[1] * factor),
                    have=(self.have[0] * factor, self.have[1] * factor), rows=self.rows * factor)

    def trim(self, x: torch.Tensor, halo: int) -> tuple[torch.Tensor, Band]:
        """`x` (this band's rows in dim -2) cut to the owned rows plus `halo` on each side."""
        have = (max(0, self.own[0] - halo), min(self.rows, self.own[1] + halo))
        if have[0] < self.have[0] or have[1] > self.have[1]:
            raise RuntimeError(f"band {self.have} cannot give rows {have}: the halo was computed too small")
        cut = x[..., have[0] - self.have[0]: have[1] - self.have[0], :]
        return cut, Band(own=self.own, have=have, rows=self.rows)

    @property
    def own_slice(self) -> slice:
        return slice(self.own[0] - self.have[0], self.own[1] - self.have[0])


def _first_bands(x: torch.Tensor, parts: Parts, halo: int
                 ) -> tuple[dict[int, torch.Tensor], dict[int, Band], list[int]]:
    rows = x.shape[-2]
    owned = split_rows(rows, parts.count)
    tensors, bands = {}, {}
    for p in parts.mine:
        tensors[p], bands[p] = Band(own=owned[p], have=(0, rows), rows=rows).trim(x, halo)
    return tensors, bands, [b - a for a, b in owned]


# --- AutoencoderKL (FLUX.1, FLUX.2) ---------------------------------------------------------------


def _group_norm(norm: nn.GroupNorm, xs: dict[int, torch.Tensor], bands: dict[int, Band], parts: Parts
                ) -> dict[int, torch.Tensor]:
    """nn.GroupNorm over the whole image, from the parts' bands: each part's per-channel mean and variance over
    the rows it owns (float32), combined over the channels of a group and over the parts (Chan's
    formula: the total mean first, then the squared deviations and the means' deviations from it), every
    band row normalised with them."""
    groups = norm.num_groups
    first = next(iter(xs))
    batch, channels = xs[first].shape[:2]
    total = channels // groups * bands[first].rows * xs[first].shape[-1]
    stats = {}
    with parts.clock(tuple(xs)):
        for p, x in xs.items():  # per channel (no copy of the rows), grouped below
            owned = x[..., bands[p].own_slice, :].float()
            mean = owned.mean((-2, -1), keepdim=True)  # two passes: CPU var_mean is several times slower
            var = (owned - mean).square().mean((-2, -1))
            mean = mean[..., 0, 0]
            stats[p] = (owned.shape[-2] * owned.shape[-1], mean.view(batch, groups, -1), var.view(batch, groups, -1))
    mean = parts.total([(n * m).sum(-1) for n, m, _ in stats.values()]) / total
    with parts.clock(tuple(xs)):
        spread = [(n * (v + (m - mean[..., None]).square())).sum(-1) for n, m, v in stats.values()]
    var = parts.total(spread) / total
    scale = torch.rsqrt(var + norm.eps).repeat_interleave(channels // groups, dim=1)  # [B, C]
    shift = -mean.repeat_interleave(channels // groups, dim=1) * scale
    if norm.affine:
        scale, shift = scale * norm.weight.float(), shift * norm.weight.float() + norm.bias.float()
    scale, shift = scale[..., None, None], shift[..., None, None]
    out = {}
    with parts.clock(tuple(xs)):
        for p, x in xs.items():
            out[p] = torch.addcmul(shift, x.float(), scale).to(x.dtype)
    return out


def _each(parts: Parts, xs: dict[int, torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]
          ) -> dict[int, torch.Tensor]:
    out = {}
    for p, x in xs.items():
        with parts.clock((p,)):
            out[p] = fn(x)
    return out


def _kl_resnet(resnet: nn.Module, xs: dict[int, torch.Tensor], bands: dict[int, Band], parts: Parts
               ) -> dict[int, torch.Tensor]:
    """diffusers' ResnetBlock2D.forward as a decoder uses it (no time embedding, no resampling), GroupNorm
    taken over the whole image."""
    if resnet.upsample is not None or resnet.downsample is not None or resnet.time_emb_proj is not None:
        raise ValueError("the split decode runs decoder resnets only (no resampling, no time embedding)")
    h = _group_norm(resnet.norm1, xs, bands, parts)
    h = _each(parts, h, lambda t: resnet.conv1(resnet.nonlinearity(t)))
    h = _group_norm(resnet.norm2, h, bands, parts)
    h = _each(parts, h, lambda t: resnet.conv2(resnet.dropout(resnet.nonlinearity(t))))
    out = {}
    for p in xs:
        with parts.clock((p,)):
            shortcut = resnet.conv_shortcut(xs[p]) if resnet.conv_shortcut is not None else xs[p]
            out[p] = (shortcut + h[p]) / resnet.output_scale_factor
    return out


def decode_kl(vae: nn.Module, z: torch.Tensor, parts: Parts) -> torch.Tensor | None:
    """AutoencoderKL / AutoencoderKLFlux2 `decode(z).sample`, split by rows over `parts`; the root gets it."""
    decoder = vae.decoder
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm):
        raise ValueError("the split decode takes decoders with GroupNorm (norm_type 'group')")
    with parts.clock(parts.mine):
        if getattr(vae, "post_quant_conv", None) is not None:
            z = vae.post_quant_conv(z)
        x = decoder.mid_block(decoder.conv_in(z), None)  # whole latent: its attention is global
    blocks = list(decoder.up_blocks)
    needs = halos(blocks, [decoder.conv_out])
    xs, bands, sizes = _first_bands(x, parts, needs[0])
    for k, block in enumerate(blocks):
        if getattr(block, "attentions", None):
            raise ValueError(f"up block {k} ({type(block).__name__}) attends over the whole image: the split "
                             "decode takes convolutional up blocks only")
        for resnet in block.resnets:
            xs = _kl_resnet(resnet, xs, bands, parts)
        if _upsampler(block) is not None:
            for upsampler in _upsampler(block):
                xs = _each(parts, xs, upsampler)
            bands = {p: b.up(2) for p, b in bands.items()}
        xs, bands = _trim(xs, bands, needs[k + 1])
    xs = _group_norm(decoder.conv_norm_out, xs, bands, parts)
    xs = _each(parts, xs, lambda t: decoder.conv_out(decoder.conv_act(t)))
    pieces = {p: t[..., bands[p].own_slice, :] for p, t in xs.items()}
    scale = next(iter(bands.values())).rows // z.shape[-2]
    return parts.gather_rows(pieces, [s * scale for s in sizes])


def _trim(xs: dict[int, torch.Tensor], bands: dict[int, Band], halo: int
          ) -> tuple[dict[int, torch.Tensor], dict[int, Band]]:
    out_x, out_b = {}, {}
    for p in xs:
        out_x[p], out_b[p] = bands[p].trim(xs[p], halo)
    return out_x, out_b


# --- AutoencoderKLWan (Cosmos-Predict2, Cosmos 3) -----------------------------------------------


def _cached_conv(conv: nn.Module, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
    """A causal convolution with its frame cache, as WanDecoder3d.forward runs conv_in and conv_out."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    i = idx[0]
    keep = x[:, :, -CACHE_T:].clone()
    if keep.shape[2] < 2 and cache[i] is not None:
        keep = torch.cat([cache[i][:, :, -1:].to(keep.device), keep], dim=2)
    out = conv(x, cache[i])
    cache[i] = keep
    idx[0] += 1
    return out


def decode_wan(vae: nn.Module, z: torch.Tensor, parts: Parts) -> torch.Tensor | None:
    """AutoencoderKLWan `decode(z).sample` (latent frame by latent frame, clamped to [-1, 1]), split by rows
    over `parts`; the root gets it."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    decoder = vae.decoder
    conv_count = sum(isinstance(m, nn.Conv3d) for m in decoder.modules())
    trunk_cache: list = [None] * conv_count
    caches: dict[int, list] = {p: [None] * conv_count for p in parts.mine}
    blocks = list(decoder.up_blocks)
    needs = halos(blocks, [decoder.conv_out])
    frames: dict[int, list[torch.Tensor]] = {p: [] for p in parts.mine}
    with parts.clock(parts.mine):
        x = vae.post_quant_conv(z)
    sizes: list[int] = []
    bands: dict[int, Band] = {}
    for i in range(x.shape[2]):
        trunk_idx = [0]
        with parts.clock(parts.mine):  # every rank runs the trunk: the mid-block attends over the whole frame
            h = _cached_conv(decoder.conv_in, x[:, :, i: i + 1], trunk_cache, trunk_idx)
            h = decoder.mid_block(h, feat_cache=trunk_cache, feat_idx=trunk_idx)
        xs, bands, sizes = _first_bands(h, parts, needs[0])
        for p in parts.mine:
            with parts.clock((p,)):
                y, band, idx = xs[p], bands[p], [trunk_idx[0]]
                for k, block in enumerate(blocks):
                    y = block(y, feat_cache=caches[p], feat_idx=idx, first_chunk=i == 0)
                    if _upsampler(block) is not None:
                        band = band.up(2)
                    y, band = band.trim(y, needs[k + 1])
                y = decoder.nonlinearity(decoder.norm_out(y))
                y = _cached_conv(decoder.conv_out, y, caches[p], idx)
                frames[p].append(y[..., band.own_slice, :])
                bands[p] = band
    pieces = {p: torch.cat(frames[p], dim=2) for p in parts.mine}
    scale = next(iter(bands.values())).rows // z.shape[-2]
    out = parts.gather_rows(pieces, [s * scale for s in sizes])
    if out is None:
        return None
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)


def _encode_halos(layers: list[nn.Module]) -> list[int]:
    """Halo rows a band needs at the input of each of the encoder's down-path `layers` (and, last, after
    them: none, its own rows exactly), each in rows of that point's resolution. A stride-2 downsampler
    (zero row padded below, a 3-row kernel) reads input rows 2i to 2i + 2 for output row i: twice the halo
    after it, plus two, which keeps every band's first row even, as the stride needs."""
    need = 0
    out = [need]
    for layer in reversed(layers):
        if getattr(layer, "mode", None) in ("downsample2d", "downsample3d"):
            need = 2 * need + 2
        else:
            need += _reach(layer)
        out.append(need)
    return out[::-1]


MAX_BAND_SHARE = 0.75
"""An input is encoded split only where every rank's band, halos included, is at most this share of its rows:
the encoder's halos double at every downsampler going back to the input (75 rows for Wan 2.1's), so a
small input gains nothing from a split (measured: 1.0x at 128 rows)."""


def _encoder_layers(vae: nn.Module) -> tuple[list[nn.Module], int]:
    """The Wan 2.1 encoder's down path (conv_in, then its blocks in order) and its spatial factor."""
    layers = [vae.encoder.conv_in, *vae.encoder.down_blocks]
    if vae.config.is_residual or vae.config.patch_size is not None or any(hasattr(m, "to_qkv") for m in layers):
        raise ValueError("the split encode takes the Wan 2.1 encoder (a flat down path of convolutions): not one "
                         "with patches, residual down blocks or attention")
    return layers, 2 ** sum(getattr(layer, "mode", "").startswith("downsample") for layer in layers)


def encode_splits(vae: nn.Module, rows: int, ranks: int) -> bool:
    """Whether an input of `rows` rows is encoded split over `ranks` ranks (encode_wan; MAX_BAND_SHARE)."""
    if ranks < 2 or vae.config.get("is_residual") or vae.config.get("patch_size") is not None:
        return False
    layers, factor = _encoder_layers(vae)
    if rows % factor or rows // factor < ranks:
        return False
    halo = _encode_halos(layers)[0]
    widest = max(min(rows, b * factor + halo) - max(0, a * factor - halo) for a, b in split_rows(rows // factor, ranks))
    return widest <= MAX_BAND_SHARE * rows


def encode_wan(vae: nn.Module, video: torch.Tensor, parts: Parts) -> torch.Tensor:
    """AutoencoderKLWan `encode(video)`'s moments (before the DiagonalGaussianDistribution) on every process:
    the down path split by rows over `parts` (each part's band of the input with its halo, frame chunk after
    frame chunk with the band's own caches), the bands gathered at latent resolution, then the mid-block
    (attention over the whole frame) and the head on the whole latent, as the encoder runs them."""
    encoder = vae.encoder
    layers, factor = _encoder_layers(vae)
    needs = _encode_halos(layers)
    rows = video.shape[-2]
    if rows % factor:
        raise ValueError(f"{rows} rows are not a multiple of the encoder's {factor}")
    owned = split_rows(rows // factor, parts.count)
    conv_count = sum(isinstance(m, nn.Conv3d) for m in encoder.modules())
    chunks = [(0, 1)] + [(1 + 4 * i, 5 + 4 * i) for i in range((video.shape[2] - 1) // 4)]
    pieces: dict[int, torch.Tensor] = {}
    frames_per_chunk: list[int] = []
    trunk_start = 0
    for p in parts.mine:
        with parts.clock((p,)):
            cache: list = [None] * conv_count
            outs = []
            for start, stop in chunks:
                own = (owned[p][0] * factor, owned[p][1] * factor)
                y, band = Band(own=own, have=(0, rows), rows=rows).trim(video[:, :, start:stop], needs[0])
                idx = [0]
                for k, layer in enumerate(layers):
                    y = _cached_conv(layer, y, cache, idx) if k == 0 else layer(y, feat_cache=cache, feat_idx=idx)
                    if getattr(layer, "mode", None) in ("downsample2d", "downsample3d"):
                        half = band.have[0] // 2
                        band = Band(own=(band.own[0] // 2, band.own[1] // 2), have=(half, half + y.shape[-2]),
                                    rows=band.rows // 2)
                    y, band = band.trim(y, needs[k + 1])
                outs.append(y)
                trunk_start = idx[0]
            frames_per_chunk = [out.shape[2] for out in outs]
            pieces[p] = torch.cat(outs, dim=2)
    features = parts.gather_rows(pieces, [b - a for a, b in owned], everywhere=True)
    with parts.clock(parts.mine):  # every rank: the mid-block attends over the whole frame
        cache = [None] * conv_count
        outs, frame = [], 0
        for count in frames_per_chunk:
            idx = [trunk_start]
            y = encoder.mid_block(features[:, :, frame: frame + count], feat_cache=cache, feat_idx=idx)
            frame += count
            y = encoder.nonlinearity(encoder.norm_out(y))
            outs.append(_cached_conv(encoder.conv_out, y, cache, idx))
        return vae.quant_conv(torch.cat(outs, dim=2))


def split_decode(vae: nn.Module, z: torch.Tensor, parts: Parts) -> torch.Tensor | None:
    """`vae.decode(z).sample` split over `parts` (the VAE's class picks how); the root gets it, others None."""
    from diffusers import AutoencoderKLWan

    if isinstance(vae, AutoencoderKLWan):
        return decode_wan(vae, z, parts)
    if hasattr(vae, "decoder") and hasattr(vae.decoder, "conv_norm_out"):
        return decode_kl(vae, z, parts)
    raise ValueError(f"the split decode does not know {type(vae).__name__}")

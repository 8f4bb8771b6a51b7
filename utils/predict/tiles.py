"""Whole fields and boxes of any size on one device: overlapping tiles, each through the model, stitched with a blend.

Along each axis, tiles of ``tile`` cells start every ``tile - overlap`` cells; the last one, cut short, ends at the
field's edge. With the tile and the overlap multiples of the model's grid (SwinIR's window, the U-Net's 2**levels),
every tile sees its windows or pooling cells where the whole field has them, and a cut-short last tile is padded
by the model as the whole field is. In the output (the input's size times the model's scale: SwinIR's upscale, 1
for the U-Net) each tile's values are weighted by :func:`ramp` (0 near a cut, 1 beyond the overlap and at the
field's own edges) and the weighted sum is divided by the summed weights. A tile's values are worst at its cut
edges (the model sees padding there, not the field beyond), where the ramp gives them no weight; what remains is
the seam error, measured against the untiled field by benchmarks/seam_error.py (docs/part1-swinir.md, "Use the
model").

A field no larger than one tile is one tile: exactly the untiled prediction.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

DEFAULT_OVERLAP = 24
"""Input cells shared by neighbouring tiles unless --overlap says otherwise (the seam-error table's choice)."""


def tile_spans(length: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """(first cell, cells) of each tile along an axis of ``length`` cells: starts every ``tile - overlap`` cells,
    the last tile cut short at the field's edge (one tile of the whole axis if it fits)."""
    if tile >= length:
        return [(0, length)]
    if not 0 <= overlap < tile:
        raise ValueError(f"overlap {overlap} must be at least 0 and smaller than the tile, {tile}")
    spans = []
    for start in range(0, length, tile - overlap):
        spans.append((start, min(tile, length - start)))
        if start + tile >= length:
            return spans
    return spans


def ramp(size: int, overlap: int, cut_before: bool, cut_after: bool) -> torch.Tensor:
    """Blend weights along one axis of a tile of ``size`` output cells. At an edge the tile shares with a neighbour
    (``cut_before``, ``cut_after``: ``overlap`` cells shared) the weight is 0 over the 3/8 of the overlap nearest the
    cut, where the tile's values are worst, then rises linearly across the middle quarter to 1; the neighbour's
    falls as this one rises, so the weights of each shared cell sum to 1. (A ramp across the whole overlap gives the
    cut edges weight: a thousand times the seam error at overlap 24, docs/part1-swinir.md.)"""
    weights = torch.ones(size)
    margin = 3 * overlap // 8
    if overlap:
        distance = torch.arange(size) + 0.5 - margin  # from the end of the margin nearest the cut
        if cut_before:
            weights = torch.minimum(weights, (distance / max(overlap - 2 * margin, 1)).clamp(min=0))
        if cut_after:
            weights = torch.minimum(weights, (distance.flip(0) / max(overlap - 2 * margin, 1)).clamp(min=0))
    return weights


def tile_count(shape: Sequence[int], tile: int, overlap: int) -> int:
    count = 1
    for length in shape:
        count *= len(tile_spans(length, tile, overlap))
    return count


def tiled(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, overlap: int,
          dims: int) -> torch.Tensor:
    """``model`` over overlapping tiles of the last ``dims`` axes of ``x`` (batch, channels, *spatial), blended;
    fp32 (batch, output channels, *spatial x the model's scale), on ``x``'s device."""
    spatial = x.shape[-dims:]
    out = total = None
    for spans in itertools.product(*(tile_spans(length, tile, overlap) for length in spatial)):
        piece = model(x[(..., *(slice(c, c + s) for c, s in spans))]).float()
        scale = piece.shape[-1] // spans[-1][1]
        if out is None:
            out = torch.zeros(*piece.shape[:-dims], *(n * scale for n in spatial), device=piece.device)
            total = torch.zeros(*(n * scale for n in spatial), device=piece.device)
        weight = torch.ones((), device=piece.device)
        for axis, ((c, s), length) in enumerate(zip(spans, spatial)):
            shape = [1] * dims
            shape[axis] = s * scale
            weight = weight * ramp(s * scale, overlap * scale, c > 0, c + s < length).to(piece.device).view(shape)
        where = (..., *(slice(c * scale, (c + s) * scale) for c, s in spans))
        out[where] += piece * weight
        total[where] += weight
    return out / total

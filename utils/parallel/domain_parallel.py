"""Domain parallelism (SwinIR's): the ranks of the "cp" mesh dimension split one field into latitude bands.

AMP, activation checkpointing and FSDP2 shrink what each layer stores and where the weights live, but
never the activations of one sample: a 720 x 1440 field in fp32 needs ~97 GB for backward whatever
the batch. Splitting the field itself does: each cp rank reads, computes and stores one band of rows
(``band_bounds``: whole rows of attention windows, as even as possible), and the result equals one
device's, because the three places where SwinIR looks across rows are given the whole field's meaning (a model
declares them in its plan, :class:`models.spec.FieldPlan`: its rows, its shifted-window blocks):

- 3x3 convolutions need the row above and below a band, which belong to the neighbours: a halo
  exchange (``halo``) adds them before the convolution (zeros at the field's top and bottom, as the
  convolution's own padding) and sends their gradients back to the neighbours in backward. The
  convolution then pads the columns only.
- The shifted windows' cyclic shift by half a window moves the top rows of every band into the band
  above (the first band's into the last): a ring shift (``ring_roll``) of those rows between
  neighbours, and back after the attention. The columns shift locally, as on one device.
- The shifted windows' mask separates the regions the shift brought together, which happens only in
  the field's last row of windows: the last band builds its mask as one device builds the bottom of
  the field's, every other band as if the field went on below it.

Window attention, LayerNorms, MLPs and the pixel shuffle work on each band alone. Padding to a window
multiple is the last band's (its bottom rows are the field's). The data loader reads only each rank's
band, plus the two rows the bicubic downsampling reaches beyond it (utils/data/era5.py), and validation's
bicubic baseline takes the same two low-resolution rows from the neighbours.

The loss is the mean over the whole field: each rank weights its band's mean by its share of the
field's elements times cp (``band_loss``). Each rank's gradients are then its band's contribution
times cp, so the average over dp x cp that FSDP2 performs (cp folded into its mesh, as for the ViT's
context parallelism) is one device's gradient, and the mean of the ranks' losses is the field's loss.

Hand-written because PyTorch lacks it: DTensor's convolution halo splits the width only, and there
is no ring shift of a dimension over a process group. Point-to-point messages run on gloo and nccl.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from utils.config import ConfigError
from utils.parallel.plans import FieldPlan, config_plan, missing_plan, model_plan

BICUBIC_REACH = 2
"""Rows a bicubic resize reads beyond the rows it maps (its 4 taps): the loader's and the baseline's halo."""
_UP, _DOWN = 1, 2  # message tags: towards the band above / below (gloo matches by tag, nccl by order)


def band_bounds(height: int, window: int, cp: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of a low-resolution field of ``height`` rows held by each of ``cp`` ranks.

    Bands are whole rows of windows of the field padded to a window multiple, the larger bands first
    (a 90-row field, window 8 = 12 window rows, over 4 ranks: 24 rows each, the last 18 + 6 of padding).
    """
    if cp > height:
        raise ConfigError(f"cp {cp} is larger than the {height} rows of the low-resolution field: every band "
                          f"needs whole rows of windows; use a cp of at most {math.ceil(height / window)}")
    windows = math.ceil(height / window)
    if cp > windows:
        raise ConfigError(f"cp {cp} would make bands thinner than a window: the {height}-row low-resolution field "
                          f"holds {windows} rows of {window}x{window} windows and a band needs whole ones; "
                          f"use --cp {windows} or fewer (or a larger field)")
    counts = [windows // cp + (r < windows % cp) for r in range(cp)]
    starts = [window * sum(counts[:r]) for r in range(cp)]
    bounds = list(zip(starts, starts[1:] + [height]))
    pad, last = windows * window - height, bounds[-1][1] - bounds[-1][0]
    if pad >= last:
        raise ConfigError(f"cp {cp} leaves the last band {last} rows, too few for the {pad} rows of reflect padding "
                          f"the model adds below the {height}-row field; use a smaller cp")
    return bounds


@dataclass(frozen=True)
class FieldBands:
    """This rank's band among the ``size`` cp ranks that split each field (rank 0: the northernmost)."""

    rank: int
    size: int
    window: int
    """The model's window size: bands are whole rows of windows."""
    group: object = dataclasses.field(default=None, compare=False)
    """The cp process group (None where only the layout is needed: the data set, pickled into workers)."""

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def bounds(self, height: int) -> tuple[int, int]:
        """This rank's rows of a low-resolution field of ``height`` rows."""
        return band_bounds(height, self.window, self.size)[self.rank]

    def layout(self) -> "FieldBands":
        return dataclasses.replace(self, group=None)

    def exchange(self, send_up=None, send_down=None, recv_above=None, recv_below=None, cyclic: bool = False) -> None:
        """Send to the bands above / below and receive from them into the given buffers, all at once.

        Without ``cyclic`` the first band has nothing above and the last nothing below. A pair of
        bands never exchanges two messages in one direction in one call, so the order needs no tags on nccl.
        """
        above = (self.rank - 1) % self.size if cyclic or not self.first else None
        below = (self.rank + 1) % self.size if cyclic or not self.last else None
        ops = []
        for tensor, peer, op, tag in ((send_up, above, dist.isend, _UP), (send_down, below, dist.isend, _DOWN),
                                      (recv_above, above, dist.irecv, _DOWN), (recv_below, below, dist.irecv, _UP)):
            if tensor is not None:
                ops.append(dist.P2POp(op, tensor, dist.get_global_rank(self.group, peer), self.group, tag))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def sum(self, value: float, device: torch.device) -> float:
        """``value`` summed over the bands (e.g. the FLOPs of one sample from those of each band)."""
        total = torch.tensor(float(value), dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.group)
        return total.item()


def _rows(x: torch.Tensor, dim: int, start: int, count: int) -> torch.Tensor:
    return x.narrow(dim, start, count).contiguous()  # messages need contiguous tensors


def _empty_rows(x: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = count
    return x.new_empty(shape)


class _Halo(torch.autograd.Function):
    """[rows from above | x | rows from below]; backward sends the halo's gradients back to their owners."""

    @staticmethod
    def forward(ctx, x, rows: int, dim: int, bands: FieldBands, zeros_at_edges: bool):
        ctx.rows, ctx.dim, ctx.bands, ctx.length, ctx.zeros = rows, dim, bands, x.shape[dim], zeros_at_edges
        above = None if bands.first else _empty_rows(x, dim, rows)
        below = None if bands.last else _empty_rows(x, dim, rows)
        bands.exchange(send_up=None if bands.first else _rows(x, dim, 0, rows),
                       send_down=None if bands.last else _rows(x, dim, x.shape[dim] - rows, rows),
                       recv_above=above, recv_below=below)
        edge = x.new_zeros(_empty_rows(x, dim, rows).shape) if zeros_at_edges else None
        parts = [above if above is not None else edge, x, below if below is not None else edge]
        return torch.cat([p for p in parts if p is not None], dim)

    @staticmethod
    def backward(ctx, grad):
        rows, dim, bands, n = ctx.rows, ctx.dim, ctx.bands, ctx.length
        top = 0 if bands.first and not ctx.zeros else rows
        grad_x = grad.narrow(dim, top, n).clone()
        from_above = None if bands.first else _empty_rows(grad, dim, rows)  # my top rows were its bottom halo
        from_below = None if bands.last else _empty_rows(grad, dim, rows)
        bands.exchange(send_up=None if bands.first else _rows(grad, dim, 0, rows),
                       send_down=None if bands.last else _rows(grad, dim, top + n, rows),
                       recv_above=from_above, recv_below=from_below)
        if from_above is not None:
            grad_x.narrow(dim, 0, rows).add_(from_above)
        if from_below is not None:
            grad_x.narrow(dim, n - rows, rows).add_(from_below)
        return grad_x, None, None, None, None


def halo(x: torch.Tensor, rows: int, dim: int, bands: FieldBands, zeros_at_edges: bool = True) -> torch.Tensor:
    """``x`` with ``rows`` rows of the neighbouring bands above and below along ``dim`` (differentiable).

    At the field's top and bottom: ``rows`` zero rows (a convolution's zero padding), or nothing
    (``zeros_at_edges=False``: a resize that clamps at the edges, as one device's does).
    """
    return _Halo.apply(x, rows, dim, bands, zeros_at_edges)


def _ring_roll(x: torch.Tensor, shift: int, dim: int, bands: FieldBands) -> torch.Tensor:
    n, s = x.shape[dim], abs(shift)
    incoming = _empty_rows(x, dim, s)
    if shift < 0:  # row i takes row i + s: my first s rows go to the band above, the next band's come here
        bands.exchange(send_up=_rows(x, dim, 0, s), recv_below=incoming, cyclic=True)
        return torch.cat([x.narrow(dim, s, n - s), incoming], dim)
    bands.exchange(send_down=_rows(x, dim, n - s, s), recv_above=incoming, cyclic=True)
    return torch.cat([incoming, x.narrow(dim, 0, n - s)], dim)


class _RingRoll(torch.autograd.Function):
    """torch.roll of the whole field along ``dim``, for one band; every band must hold at least |shift| rows."""

    @staticmethod
    def forward(ctx, x, shift: int, dim: int, bands: FieldBands):
        ctx.shift, ctx.dim, ctx.bands = shift, dim, bands
        return _ring_roll(x, shift, dim, bands)

    @staticmethod
    def backward(ctx, grad):
        return _ring_roll(grad, -ctx.shift, ctx.dim, ctx.bands), None, None, None  # a roll's adjoint: the roll back


def ring_roll(x: torch.Tensor, shift: int, dim: int, bands: FieldBands) -> torch.Tensor:
    """This band of the whole field rolled by ``shift`` along ``dim`` (differentiable)."""
    return _RingRoll.apply(x, shift, dim, bands)


# ------------------------------------------------------------------ shifted windows (FieldPlan.shifted)


def _band_roll(bands: FieldBands, x: torch.Tensor, shift: int) -> torch.Tensor:
    """SwinTransformerBlock.roll for a band of (B, H, W, C): rows across the bands, columns locally."""
    return torch.roll(ring_roll(x, shift, 1, bands), shifts=shift, dims=2)


def _band_mask(block: nn.Module, bands: FieldBands, ws: int, H: int, W: int, x: torch.Tensor) -> torch.Tensor:
    """SwinTransformerBlock.attention_mask for a band of H rows: only the field's last window row mixes
    regions of the field vertically, so a band above the last one is masked as the top of a taller field."""
    if bands.last:
        return type(block).attention_mask(block, H, W, x)
    return type(block).attention_mask(block, H + ws, W, x)[:(H // ws) * (W // ws)]


def _halo_conv(conv: nn.Conv2d, bands: FieldBands) -> None:
    rows = conv.padding[0]
    if not rows:
        return
    same = conv.stride[0] == 1 and conv.dilation[0] == 1 and conv.kernel_size[0] == 2 * rows + 1
    if not same or conv.padding_mode != "zeros":
        raise ConfigError(f"domain parallelism has no halo for {conv}: only stride-1 'same' convolutions")
    conv.padding = (0, conv.padding[1])  # the rows come from the halo (zeros at the field's edges)
    # prepend: on the plain input, before tensor parallelism's own hook makes it a (replicated) DTensor.
    conv.register_forward_pre_hook(lambda _module, args: (halo(args[0], rows, 2, bands), *args[1:]), prepend=True)


def apply_domain_parallel(model: nn.Module, cp_mesh) -> nn.Module:
    """Make a model whose plan splits fields (:class:`models.spec.FieldPlan`; SwinIR's) compute one latitude band per
    rank of ``cp_mesh`` (1-D); in place, returned.

    Its input must then be this rank's band of the low-resolution field (``FieldBands.bounds``), and
    its output is the band of the high-resolution field.
    """
    plan = model_plan(model).cp
    if not isinstance(plan, FieldPlan):
        raise missing_plan(model, "domain-parallel (cp: FieldPlan)", "--cp 1")
    refused = plan.refuse(model)
    if refused:
        raise ConfigError(refused)
    # window 1: the hooks only exchange rows; where the bands lie (bounds, from the plan's rows) is the data's.
    bands = FieldBands(cp_mesh.get_local_rank(), cp_mesh.size(), 1, cp_mesh.get_group())
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            _halo_conv(module, bands)
    for block in plan.shifted(model):
        block.roll = functools.partial(_band_roll, bands)
        block.attention_mask = functools.partial(_band_mask, block, bands, plan.window(block))
    return model


def check_band_loss(cfg) -> None:
    """ConfigError unless the loss is a mean over the field's points, which domain parallelism sums band by band
    (field_bands checks with it; plan.py enumerates only what it accepts)."""
    if cfg.train.loss not in ("l1", "mse"):
        raise ConfigError(f"loss {cfg.train.loss} is not a mean over the field's points, which domain parallelism "
                          "sums band by band: use --loss l1 or mse with cp")


def field_bands(cfg, cp_mesh) -> Optional[FieldBands]:
    """This rank's band when the config's model splits its fields over ``cp_mesh`` (its plan's cp a FieldPlan, cp > 1),
    else None (the ViT's context parallelism splits tokens inside the model: its ranks read whole fields)."""
    plan = config_plan(cfg.model).cp
    if cp_mesh is None or cp_mesh.size() == 1 or not isinstance(plan, FieldPlan):
        return None
    check_band_loss(cfg)
    return FieldBands(cp_mesh.get_local_rank(), cp_mesh.size(), plan.rows(cfg.model.model_args), cp_mesh.get_group())


def band_loss(loss_fn: Callable, bands: Optional[FieldBands]) -> Callable:
    """The loss of this rank's band weighted by its share of the field's points times cp (see the module
    docstring); ``loss_fn`` itself without bands."""
    if bands is None:
        return loss_fn

    def weighted(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        points = torch.tensor(float(pred.numel()), device=pred.device)
        field = points.clone()
        dist.all_reduce(field, group=bands.group)
        return loss_fn(pred, target) * (points * bands.size / field)

    return weighted


def gather_bands(x: torch.Tensor, dim: int, bands: FieldBands) -> torch.Tensor:
    """The whole field on the CPU of the first band's rank, band by band (never whole on a device); the
    other ranks get their own band, on the CPU."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(bands.size)]
    dist.all_gather(sizes, torch.tensor([x.shape[dim]], device=x.device), group=bands.group)
    if not bands.first:
        dist.send(x.contiguous(), dist.get_global_rank(bands.group, 0), group=bands.group)
        return x.cpu()
    parts = [x.cpu()]
    for rank, rows in enumerate(torch.cat(sizes).tolist()[1:], start=1):
        part = _empty_rows(x, dim, rows)
        dist.recv(part, dist.get_global_rank(bands.group, rank), group=bands.group)
        parts.append(part.cpu())
    return torch.cat(parts, dim)

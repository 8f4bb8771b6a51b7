"""Ensemble members in training (Part V, ``--ensemble M --loss crps``): each sample's M members as M perturbed copies
of its input in the batch, and, in train_mp.py, on a dimension ``ens`` of the device mesh of their own.

The step stays the scripts' own, with two calls around the forward::

    members = Members(cfg, mesh)                      # mesh: train_mp.py's (its "ens" dimension), or None
    x = members.inputs(inputs, state.step, ids)       # (M / ens x B, C, H, W): this rank's members, perturbed
    loss = loss_fn(members.gather(model(x)), target)  # the CRPS over all M members (M, B, C, H, W)

No model is told about members: what it sees is a batch. The members differ by their input alone (a noise input that
works for any model): member k of a sample gets Gaussian noise of ``member_noise`` x each channel's std, drawn from a
generator seeded by (seed, step, the sample's place in the global batch, k) only, so a member's input is the same on
any rank of any layout, and a resumed run draws the uninterrupted run's noise. ``gather`` is PyTorch's autograd-aware
all-gather (its backward sums each member's gradient from every ens rank into the rank that computed it); every ens
rank then holds the same loss, so each member's gradient arrives ens times, and the average over ens x dp that data
parallelism takes anyway divides it out: the gradients of one process that holds all M members.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed._functional_collectives as funcol

from utils.config import Config, ConfigError

# The keys of this technique and the scripts that apply them (utils/config.py collects every file's). A pipeline's
# loss is each microbatch's on the last stage, and the CRPS needs every member of a sample at once: not train_pp.py.
APPLIED_BY = {
    "ens": ("train_mp.py", "estimate_memory.py"),
    ("ensemble", "crps_alpha", "member_noise"): ("train.py", "train_with_profiling.py", "train_ddp.py", "train_fsdp.py",
                                                 "train_mp.py", "estimate_memory.py"),
}

NOISE_STREAM = 59  # the members' noise, a stream of its own beside the crops' and the steps' (any fixed number)

# torch >= 2.9 names it all_gather_single_autograd and deprecates the old name; the floor (2.7) has the old one only.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def noise_seed(seed: int, step: int, sample: int, member: int) -> int:
    """The seed of member ``member``'s noise for one sample of one step (NumPy's SeedSequence mixes the four)."""
    return int(np.random.SeedSequence([seed, NOISE_STREAM, step, sample, member]).generate_state(1, np.uint64)[0])


def sample_ids(batch: int, dp_rank: int, dp_size: int) -> list[int]:
    """Places in the global batch of this rank's ``batch`` samples: the samplers deal rank r the places r, r + dp,
    r + 2 dp, ... (utils/data/common.py, ResumableDistributedSampler)."""
    return [i * dp_size + dp_rank for i in range(batch)]


class Members:
    """This rank's share of the ensemble: ``cfg.train.ensemble`` members, ``ensemble / ens`` of them here.

    ``mesh``: a DeviceMesh with a dimension "ens" (train_mp.py --ens N > 1), else None (every member here).
    ``bands``: SwinIR's field bands (cp) are refused: a band holds part of the field whose noise is drawn whole.
    ``dp``: (this rank's data-parallel rank, their number): where its samples sit in the global batch.
    """

    def __init__(self, cfg: Config, mesh=None, bands=None, dp: tuple[int, int] = (0, 1)):
        t, m = cfg.train, cfg.model
        self.total, self.seed = t.ensemble, t.seed
        self.group = mesh["ens"] if mesh is not None and "ens" in (mesh.mesh_dim_names or ()) else None
        ens, rank = (self.group.size(), self.group.get_local_rank()) if self.group is not None else (1, 0)
        if self.total % ens:
            raise ConfigError(f"ens {ens} must divide ensemble {self.total}: each ens rank holds as many members")
        if bands is not None and self.total > 1:
            raise ConfigError("--ensemble draws each member's noise over the whole field, and SwinIR's cp holds a band "
                              "of it: use --cp 1 with --ensemble (or --tp, --ens)")
        self.dp = dp
        per = self.total // ens
        self.local = range(rank * per, (rank + 1) * per)
        std = m.std if m.std else [1.0] * m.in_chans  # a model of stored units (no statistics): noise in those
        self.scale = t.member_noise * torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)

    def inputs(self, x: torch.Tensor, step: int, samples: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``x`` (B, C, ...) as this rank's members of each sample, member-major: (M / ens x B, C, ...), member k's
        copy plus its noise. ``samples``: each sample's place in the global batch (default: the samplers' places
        for ``dp``, :func:`sample_ids`). With one member, ``x`` itself."""
        if self.total == 1:
            return x
        samples = sample_ids(len(x), *self.dp) if samples is None else samples
        if len(samples) != len(x):
            raise ValueError(f"{len(samples)} sample ids for a batch of {len(x)}")
        noise = torch.empty((len(self.local), *x.shape), dtype=torch.float32, device=x.device)
        generator = torch.Generator(device=x.device)
        for i, k in enumerate(self.local):
            for j, sample in enumerate(samples):
                generator.manual_seed(noise_seed(self.seed, step, sample, k))
                noise[i, j] = torch.randn(x.shape[1:], generator=generator, device=x.device)
        scale = self.scale.to(x.device).view(1, *self.scale.shape[1:], *([1] * (x.dim() - 4)))
        return (x.unsqueeze(0) + scale * noise).to(x.dtype).flatten(0, 1)

    def gather(self, pred: torch.Tensor) -> torch.Tensor:
        """Every member's prediction, (M, B, C, ...), from this rank's (M / ens x B, C, ...): gathered over ens with
        autograd (the backward returns each rank the gradient of its own members, summed over the ens ranks).
        With one member, ``pred`` itself."""
        if self.total == 1:
            return pred
        if self.group is not None:
            pred = _all_gather(pred.contiguous(), 0, self.group)
        return pred.unflatten(0, (self.total, -1))


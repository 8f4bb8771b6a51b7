"""What differs between the torch versions this project supports, in one place: from the tested floor
(requirements.txt) to the pin (constraints.txt). Each difference is either worked around here, for the
torch releases that need it, or refused in one line that names the torch it needs and the one found.
``make test-torch TORCH=X`` runs every script's laptop command on torch X (tests/torch_versions.py).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import schedules

from utils.config import ConfigError


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.7.1+cu126' -> (2, 7). Site builds carry suffixes such as
    '2.8.0a0+git1234.nv25.05' whose pre-release tag would sort them below 2.8.0, so only the release counts."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def require_torch(feature: str, release: tuple[int, int], why: str = "") -> None:
    """ConfigError (one line, exit 2) when this torch is older than ``release``."""
    if torch_release() < release:
        needed = ".".join(map(str, release))
        raise ConfigError(f"{feature} needs torch >= {needed}{f' ({why})' if why else ''}; this is torch "
                          f"{torch.__version__}")


class _EveryWork:
    """The works of one batch of P2P ops, waited for together (what a schedule calls ``wait()`` on)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def _batch_p2p_every_work(p2p_ops: list, desc=None):
    return _EveryWork(dist.batch_isend_irecv(p2p_ops)) if p2p_ops else None


def keep_every_p2p_work(group) -> None:
    """torch < 2.8's pipeline schedules keep only the last Work of each batch of sends and receives
    (``batch_isend_irecv(...).pop()``): right for NCCL, which coalesces a batch into one Work, but gloo returns
    one Work per tensor and cancels the operations whose Work is dropped. A stage boundary that carries several
    tensors (SwinIR's tokens, long skip and input), or 1F1B's fused send + receive, then waits forever on gloo.
    Fixed in torch 2.8 (pytorch/pytorch#152938); for older torch on gloo, the schedules get a batch function
    that keeps and waits for every Work."""
    if torch_release() < (2, 8) and dist.get_backend(group) == "gloo":
        schedules._batch_p2p = _batch_p2p_every_work


def check_schedule(schedule: str, group) -> None:
    """ZB-V puts two adjacent stages on one rank (the V's turn). Before torch 2.12 the schedule sends between them
    like between ranks, a send to itself that nccl serves and gloo cannot ("Pair is not connected" in 2.11, "Bad
    file descriptor" in 2.7): refused on gloo."""
    if schedule == "zbv" and dist.get_backend(group) == "gloo":
        require_torch("--pp_schedule zbv on gloo (CPU)", (2, 12),
                      "older ones send between a rank's own two stages, which gloo cannot; nccl can, and so can "
                      "interleaved_1f1b here")


def average_fsdp_gradients(module: nn.Module, mesh) -> None:
    """FSDP2 on gloo before torch 2.9 sums the gradients it means to average: it asks gloo's reduce-scatter for an
    average, which gloo's runs as a sum (pytorch/pytorch#162338), so every step applied dp x the gradient, silently
    (AdamW hardly minds the scale; clipping and SGD would). For those releases the reduced gradient is divided by
    the shard group's size in FSDP's all-reduce hook. Replicas (a 2-D mesh: HSDP, train_pp.py's --pp_dp ddp) also
    all-reduce with an average, which gloo refuses before torch 2.8 ("Cannot use ReduceOp.AVG with Gloo")."""
    if dist.get_backend(mesh.get_group(0)) != "gloo":
        return
    if mesh.ndim > 1 and mesh.size(0) > 1:
        require_torch("FSDP2 with replicas on gloo (CPU: --hsdp_replicas > 1, --pp_dp ddp)", (2, 8),
                      "gloo's all-reduce averages from 2.8 on")
    if torch_release() < (2, 9):
        shards = mesh.size(mesh.ndim - 1)
        module.set_all_reduce_hook(lambda grad: grad.div_(shards))


REPLICATED_CONV_GRADIENT_FIXED = (2, 15)
"""Before it (2.7.1 and 2.11 checked, 2.12-2.14 not): DTensor's convolution backward marks the weight gradient of a
replicated convolution Partial although every rank holds all of it, so it is summed over the tensor-parallel ranks:
tp x the gradient, silently (check_layouts.py: the ViT's patch_embed.weight and SwinIR's conv_first.weight off by
1.0 relative; AdamW hardly minds the scale, clipping and SGD would). Before 2.10 the same backward also handed a
plain tensor back as the input's gradient (SwinIR's tensor parallelism failed): computed locally, neither happens."""


def _local_convolution(conv: nn.Module, x):
    # A replicated convolution computed on the local tensors (the same values on every rank), its output handed on
    # as the replicated DTensor DTensor's own convolution would give; the weights' gradients stay replicated.
    from torch.distributed.tensor import DTensor, Replicate

    mesh = conv.weight.device_mesh
    local = x.to_local() if isinstance(x, DTensor) else x
    bias = conv.bias.to_local() if conv.bias is not None else None
    return DTensor.from_local(conv._conv_forward(local, conv.weight.to_local(), bias), mesh, [Replicate()],
                              run_check=False)


def replicated_convolutions_locally(module: nn.Module) -> None:
    """On torch before REPLICATED_CONV_GRADIENT_FIXED, a convolution whose parameters are replicated DTensors
    computes on its local tensors instead (see there); later torch, and other modules, are left as they are."""
    if torch_release() < REPLICATED_CONV_GRADIENT_FIXED and isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        module.forward = _local_convolution.__get__(module)

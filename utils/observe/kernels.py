"""What one training step's kernels are and what they move: the class of each aten op (matmul, attention, convolution,
normalisation, elementwise, copies, optimizer) and the bytes its operands cross memory with, counted by a
TorchDispatchMode as if each operand crossed once (views move nothing, an in-place op reads and writes its tensor).

benchmarks/roofline.py times these classes on a device; utils/plan/compute.py predicts a step's time from the same
classes and bytes on the meta device. Hand-written: nothing in PyTorch counts operand traffic per op (the profiler
records shapes of inputs, not of outputs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

CLASSES = ("matmul", "attention", "convolution", "normalisation", "elementwise", "copies", "optimizer")
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_addmm_activation", "_scaled_mm", "linear"}
# Data movement without arithmetic: the class a fusing compiler removes first.
COPIES = {"copy_", "_to_copy", "clone", "cat", "stack", "roll", "constant_pad_nd", "reflection_pad2d",
          "reflection_pad2d_backward", "index", "index_put_", "index_select", "gather", "scatter", "scatter_add_",
          "pixel_shuffle", "pixel_unshuffle", "slice_backward", "select_backward", "narrow_copy", "repeat",
          "new_zeros", "zero_", "fill_", "zeros_like", "_unsafe_index", "_unsafe_index_put"}
NO_KERNEL = ("empty", "_local_scalar_dense", "set_", "resize_", "lift_fresh", "record_stream")


def kernel_class(op: str) -> str:
    """The class of an aten op given as "aten.mm", "aten::mm" or "mm"."""
    name = op.replace("::", ".").split(".")[-1]
    if name in MATMULS:
        return "matmul"
    if "attention" in name:
        return "attention"
    if "convolution" in name:
        return "convolution"
    if "norm" in name:
        return "normalisation"
    if name.startswith(("_fused_adam", "_fused_sgd", "_foreach_")):
        return "optimizer"
    if name in COPIES:
        return "copies"
    return "elementwise"


def nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def is_view(func) -> bool:
    """An op whose results alias an input without writing it (view, transpose, expand, detach...): no kernel."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def operand_bytes(func, args, kwargs, out) -> Optional[int]:
    """Bytes the kernel of one aten call reads and writes, each operand once; None for a call that runs no kernel."""
    if is_view(func) or str(func.overloadpacket).split(".")[-1].startswith(NO_KERNEL):
        return None
    return sum(map(nbytes, tree_leaves((args, kwargs or {})))) + sum(map(nbytes, tree_leaves(out)))


class TrafficMode(TorchDispatchMode):
    """Bytes read and written per aten op, as if each operand crossed memory once (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        moved = operand_bytes(func, args, kwargs, out)
        if moved is not None:
            self.bytes[str(func.overloadpacket)] += moved
        return out


@dataclass(frozen=True)
class Op:
    """One kernel of a step: its class, FLOPs (mul and add counted apart), operand bytes, and for attention the head
    dimension (its matmuls' inner size) and the number of scores (query x key pairs) it computes."""

    kind: str
    flops: float
    bytes: int
    head_dim: int = 0
    scores: float = 0.0


class OpListMode(TorchDispatchMode):
    """Every kernel-running aten call of what runs inside it, as :class:`Op` (FLOPs from FlopCounterMode's own
    per-op formulas): the input of a per-operation roofline."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moved = operand_bytes(func, args, kwargs, out)
        if moved is not None:
            count = flop_registry.get(func.overloadpacket)
            flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
            self.ops.append(Op(kernel_class(str(func.overloadpacket)), flops, moved))
        return out


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (flash or memory-efficient, as SDPA runs on a GPU) costs, without its result: on
    the meta device SDPA falls back to the math path, whose scores matrix a fused kernel never writes. Forward: two
    matmuls (4 x scores x head_dim FLOPs), q, k, v and the output read or written once; backward: five (the scores
    recomputed), twice the traffic."""

    @staticmethod
    def forward(ctx, ops, q, k, v, mask):
        scores = q.shape[:-1].numel() * k.shape[-2]
        moved = 2 * (nbytes(q) + nbytes(k) + nbytes(v)) + nbytes(mask)
        ctx.save_for_backward(q, k, v, mask)
        ctx.cost = (ops, scores, moved)
        ops.append(Op("attention", 4.0 * scores * q.shape[-1], moved, q.shape[-1], scores))
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        ops, scores, moved = ctx.cost
        ops.append(Op("attention", 10.0 * scores * q.shape[-1], 2 * moved, q.shape[-1], 2 * scores))
        mask_grad = torch.empty_like(mask) if mask is not None and ctx.needs_input_grad[4] else None
        return None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), mask_grad


class FusedAttentionMode(TorchFunctionMode):
    """Inside it, F.scaled_dot_product_attention is costed as a fused kernel (:class:`_FusedAttention`) into ``ops``."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttention.apply(self.ops, q, k, v, kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return func(*args, **kwargs)


def step_ops(model: torch.nn.Module, sample: torch.Tensor) -> list:
    """The kernels of one training step (forward, backward of ``.sum()``) of ``model`` on ``sample``, run on the meta
    device: per aten call, and SDPA as a fused kernel (its softmax never written)."""
    ops: list = []
    with FusedAttentionMode(ops), OpListMode(ops):
        model(sample).float().sum().backward()
    return ops

"""What ``build_model`` does around a model it must not change, a library's as much as yours: complex parameters
stored as their real views, and physical units standardised for a model that takes no ``mean`` and ``std``.

Both work on the built model from outside, by hooks on its modules, never by subclassing its classes: a library's
class may not allow a subclass (neuraloperator's spectral weights live in tensorly-torch's ``FactorizedTensor``, whose
``__init_subclass__`` demands a ``name``; torch's ``parametrize`` makes a subclass of the owning module's class, and
failed on it with a TypeError). Every hook takes what it changes from the module it is called with (paths and
numbers in its arguments, no module of its own), so that a deep copy of the model (check_layouts.py's, the memory
trace's) hooks its own modules, not the original's.
"""

from __future__ import annotations

import copy
import functools
from typing import Optional, Sequence

import torch
from torch import nn

REAL_VIEWS = "parametrizations"
"""The child module of an owner that holds its complex parameters' real views, one ``RealView`` per name: the
checkpoint keys (``<owner>.parametrizations.<name>.original0``) are those torch's parametrize gave them."""
_COMPLEX = "_complex_parameters"  # owner.__dict__: the names of its complex parameters, stored as real views


class RealView(nn.Module):
    """A complex parameter's real view, (..., 2), the parameter that the optimizer, DDP, FSDP2 and DCP see."""

    def __init__(self, real: nn.Parameter):
        super().__init__()
        self.original0 = real


def store_complex_as_real(model: nn.Module) -> list[str]:
    """Each complex parameter stored as its real view: fused AdamW, DDP's and FSDP2's collectives (gloo and nccl
    reduce no complex numbers) and DCP see real numbers, while the model's own code, unchanged, still reads a complex
    tensor under the parameter's name (a view of the same memory, no copy). AdamW on the real view is AdamW on the
    complex numbers (torch's own optimizer views them so). In checkpoints the weight is
    ``<owner>.parametrizations.<name>.original0``. Returns the names.

    The complex tensor is a plain attribute of the owner, ``view_as_complex`` of the stored parameter, made afresh by
    a forward pre-hook on the owner and on each module above it — whichever runs the code that reads it, as the owner
    need not be called (a FactorizedTensor is read by its SpectralConv) — so that it views the parameter that is there
    when that code runs: the one FSDP2 has just gathered, the one a recomputation (activation checkpointing)
    differentiates. Between calls it stays the last view made (read outside a forward, after ``model.to(...)``, it
    is up to date from the next forward on). ``copy.deepcopy`` refuses such a view (it is not a leaf): copy the model
    with :func:`copy_model`."""
    names = [n for n, p in model.named_parameters() if p.is_complex()]
    below: dict[str, list[tuple[str, str]]] = {}  # module path -> (path of an owner under it, relative; name)
    for name in names:
        owner_path, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_path)
        param = owner._parameters.pop(attribute)  # the one entry nn.Module keeps it in; the attribute follows below
        if REAL_VIEWS not in owner._modules:
            owner.add_module(REAL_VIEWS, nn.ModuleDict())
        owner.get_submodule(REAL_VIEWS)[attribute] = RealView(
            nn.Parameter(torch.view_as_real(param.detach()), requires_grad=param.requires_grad))
        owner.__dict__.setdefault(_COMPLEX, []).append(attribute)
        _fresh_views(owner, owned=(("", attribute),))
        parts = owner_path.split(".") if owner_path else []
        for depth in range(len(parts) + 1):  # the root, ..., the owner
            below.setdefault(".".join(parts[:depth]), []).append((".".join(parts[depth:]), attribute))
    for path, owned in below.items():
        model.get_submodule(path).register_forward_pre_hook(functools.partial(_fresh_views, owned=tuple(owned)))
    return names


def _fresh_views(module: nn.Module, _args=(), *, owned: Sequence[tuple[str, str]]) -> None:
    for path, name in owned:
        owner = module.get_submodule(path)
        owner.__dict__[name] = torch.view_as_complex(owner.get_submodule(REAL_VIEWS)[name].original0)


def copy_model(model: nn.Module, memo: Optional[dict] = None) -> nn.Module:
    """``copy.deepcopy(model, memo)`` for a model whose complex parameters are stored as real views: the views are
    left out of the copy and made afresh from the copy's own parameters (a ``memo`` may swap those for others: the
    memory trace's fake tensors, utils/memory/traced.py)."""
    owners = [(owner, name) for owner in model.modules() for name in owner.__dict__.get(_COMPLEX, ())]
    views = [owner.__dict__.pop(name) for owner, name in owners]
    try:
        copied = copy.deepcopy(model, memo)
    finally:
        for (owner, name), view in zip(owners, views):
            owner.__dict__[name] = view
    for owner in copied.modules():
        _fresh_views(owner, owned=tuple(("", name) for name in owner.__dict__.get(_COMPLEX, ())))
    return copied


def complex_state_dict(state_dict: dict) -> dict:
    """A state_dict of :func:`store_complex_as_real`'s model with each real view back under its own name, complex:
    what the model's own class, built without this project, loads (``load_state_dict``)."""
    plain, marker = {}, f".{REAL_VIEWS}."
    for key, value in state_dict.items():
        owner, found, rest = f".{key}".partition(marker)  # the leading dot: the root module's own parameters
        if found and rest.endswith(".original0"):
            plain[f"{owner}.{rest[:-len('.original0')]}"[1:]] = torch.view_as_complex(value.contiguous())
        else:
            plain[key] = value
    return plain


def standardise_around(model: nn.Module, mean: Sequence[float], std: Sequence[float],
                       out_mean: Sequence[float] = (), out_std: Sequence[float] = ()) -> None:
    """A model that takes no ``mean`` and ``std`` (a library's, which cannot normalise physical units inside) reads
    its input standardised per channel, ``(x - mean) / std``, and its output is turned back into physical units,
    ``y * out_std + out_mean`` (the inputs' statistics where the outputs are the same channels), both in fp32, by a
    forward pre-hook and a forward hook on the model: what models/common.py's PhysicalUnitsModel does inside."""
    out_mean, out_std = (out_mean, out_std) if len(out_mean) else (mean, std)
    model.register_forward_pre_hook(functools.partial(_standardised, mean=tuple(mean), std=tuple(std)))
    model.register_forward_hook(functools.partial(_in_units, mean=tuple(out_mean), std=tuple(out_std)))


def _per_channel(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    # Made at each call, on the input's device and in its tensor mode (fake tensors in the memory trace): a tensor
    # kept from an earlier call could be on another device, or real where the trace needs a fake one.
    return torch.tensor(values, dtype=torch.float32, device=like.device).view(1, -1, *[1] * (like.dim() - 2))


def _standardised(_module: nn.Module, args: tuple, *, mean: Sequence[float], std: Sequence[float]) -> tuple:
    x = args[0].float()
    return ((x - _per_channel(mean, x)) / _per_channel(std, x), *args[1:])


def _in_units(_module: nn.Module, _args, output: torch.Tensor, *, mean: Sequence[float],
              std: Sequence[float]) -> torch.Tensor:
    return output.float() * _per_channel(std, output) + _per_channel(mean, output)

"""Precision, in one place: the dtype names of the configs, autocast and the gradient scaler.

Configs name dtypes as strings: ``amp_dtype`` ("none", "bf16", "fp16": autocast's compute dtype),
``param_dtype`` and ``reduce_dtype`` (FSDP2's mixed precision: "fp32", "bf16"). Every table that turns
such a name into a torch dtype or a byte count reads :data:`DTYPES`.

``keep_fp32`` (:func:`apply_keep_fp32`) keeps named parts of a model in fp32 under autocast: the ones its spec's
``fp32_modules`` names (models/<name>/spec.py), or the config's ``fp32_modules``. Applied from outside the model, by
wrapping those modules' forwards, in the techniques' order: after tensor and context parallelism, before activation
checkpointing and torch.compile.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from typing import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from models.spec import class_spec
from utils.config import ConfigError

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    # the estimate traces autocast's dtypes per operation, not the kept parts' fp32 activations: it refuses them
    ("keep_fp32", "fp32_modules"): ("train.py", "train_with_profiling.py", "train_ddp.py", "train_fsdp.py",
                                    "train_mp.py", "train_pp.py"),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a config name stands for ("none", no autocast, computes in fp32)."""
    if name == "none":
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)} or none")
    return DTYPES[name]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a config's dtype name."""
    return dtype_of(name).itemsize


def autocast(device: torch.device, amp_dtype: str):
    """Autocast context for the forward pass (a no-op context for ``amp_dtype: none``)."""
    dtype = AMP_DTYPES[amp_dtype]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(device: torch.device, amp_dtype: str) -> torch.amp.GradScaler:
    """Loss scaling only for fp16, whose 5-bit exponent underflows small gradients; bf16 has fp32's range."""
    return torch.amp.GradScaler(device.type, enabled=amp_dtype == "fp16")


def fp32_module_names(model: nn.Module, patterns: Sequence[str] = ()) -> list[str]:
    """The names of the modules ``keep_fp32`` keeps in fp32: those ``patterns`` match (the config's fp32_modules,
    each of which must match one), else those the model's spec declares; only the outermost of nested matches (a kept
    module's children run inside its fp32 region anyway)."""
    given = list(patterns)
    declared = given or list(class_spec(type(model)).fp32_modules)
    if not declared:
        raise ConfigError(f"keep_fp32: {type(model).__name__}'s spec declares no fp32_modules: name the parts to "
                          "keep with --fp32_modules (patterns on its module names, e.g. '[\"*norm*\", head]')")
    names = [name for name, _ in model.named_modules() if name and any(fnmatch.fnmatch(name, p) for p in declared)]
    for pattern in given:  # a typo in a config would otherwise keep nothing, silently
        if not any(fnmatch.fnmatch(name, pattern) for name in names):
            raise ConfigError(f"fp32_modules: {pattern!r} matches no module of {type(model).__name__} (its modules: "
                              f"{', '.join(n for n, _ in list(model.named_modules())[1:12])}, ...)")
    if not names:
        raise ConfigError(f"keep_fp32: the spec's fp32_modules {declared} match no module of this "
                          f"{type(model).__name__}: name the parts to keep with --fp32_modules")
    return [name for name in names if not any(name.startswith(outer + ".") for outer in names)]


def _in_fp32(forward):
    """A kept module's forward, outside autocast: its low-precision inputs cast to fp32 (the dtype of its weights),
    so it computes and returns fp32. A wrapper, not a pre-hook and a hook that enter and leave autocast: torch.compile
    traces a ``with`` block, but not an autocast region opened in one hook and closed in another."""

    @functools.wraps(forward)
    def kept(*args, **kwargs):
        tensor = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if tensor is None:
            return forward(*args, **kwargs)
        with torch.autocast(tensor.device.type, enabled=False):
            return forward(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))

    return kept


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


def apply_keep_fp32(model: nn.Module, enabled: bool, patterns: Sequence[str] = ()) -> nn.Module:
    """Keep the named parts of ``model`` (:func:`fp32_module_names`) in fp32 under autocast: their inputs cast to fp32,
    autocast off inside them, so their outputs are fp32 (the modules after them cast back, as autocast does). The
    model's code is untouched (each kept module's forward is wrapped on the instance) and its parameter names too: checkpoints stay interchangeable with runs without it."""
    if not enabled:
        return model
    modules = dict(model.named_modules())
    for name in fp32_module_names(model, patterns):
        # The instance's forward, which nn.Module's call (and so its hooks, AC's, FSDP2's) calls: the class is untouched.
        modules[name].forward = _in_fp32(modules[name].forward)
    return model

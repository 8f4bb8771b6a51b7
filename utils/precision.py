"""Precision, in one place: the dtype names of the configs, autocast and the gradient scaler.

Configs name dtypes as strings: ``amp_dtype`` ("none", "bf16", "fp16": autocast's compute dtype),
``param_dtype`` and ``reduce_dtype`` (FSDP2's mixed precision: "fp32", "bf16"). Every table that turns
such a name into a torch dtype or a byte count reads :data:`DTYPES`.
"""

from __future__ import annotations

import contextlib

import torch

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

"""The vocabulary of a model's training step as a list of layers in forward order: what autograd saves for backward.

A :class:`Layer` holds the bytes one operation saves for backward, what is alive only while its forward or
its backward runs, and the activation-checkpointing unit it belongs to (``ac: none``, ``block`` or ``layer``).
:class:`Precision` types the saved tensors for a device and the mixed-precision settings. Each model's own graph is
written beside it, in its hand-written memory description (``models/swinir/memory.py``, ``models/vit/memory.py``,
``models/unet3d/memory.py``; utils/memory/shapes.py says what a description provides).

:func:`held_after_forward` is what the graph holds at the end of the forward pass (the estimate's
activations); :func:`simulate_peak` walks the same list as autograd walks it: forward adds what each layer
saves; backward, in reverse, frees it once the layer's backward has run, re-creates a checkpointed unit's
tensors when backward reaches it, and adds each layer's transient tensors (gradients in flight, attention
logits and their gradients, a super-resolver's high-res output gradients) — the estimate's temporary peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from utils.precision import dtype_bytes

LN_STATS_BYTES = 8  # LayerNorm keeps mean and 1/std per token, in fp32 even for bf16 inputs


@dataclass
class Layer:
    """One operation of the training graph, in forward order, for the memory bookkeeping (bytes)."""

    part: str
    """Category it is reported under: a part of the model, as its description names them (stem, blocks, loss...)."""
    saved: float
    """Saved for backward; freed once its backward has run (shared tensors: by the first holder)."""
    forward_extra: float = 0.0
    """Alive only while its forward runs (outputs not yet consumed, e.g. attention logits)."""
    backward_extra: float = 0.0
    """Alive only while its backward runs: incoming and outgoing gradients, gradients in flight."""
    unit: Optional[int] = None
    """Activation-checkpointing unit it belongs to (recomputed in backward), if any."""
    unit_input: bool = False
    """The unit's input: the one tensor a checkpointed unit keeps through forward."""
    stage_unit: Optional[int] = None
    """The unit a pipeline cuts at (the ViT's block, SwinIR's RSTB) it belongs to; None: the stem or the tail."""


def loss_layer(loss: str, loss_space: str, pred_bytes: float, batch: int, channels: int) -> Layer:
    """The loss on the fp32 prediction (``pred_bytes`` = one fp32 copy of the predicted batch).

    L1 saves pred - target (for |.|'s gradient), the CRPS also the sort's int64 indices; MSE saves prediction and
    target; relative L2 saves pred - target and the fp32 norms per sample (of the difference, and of the target for the
    division). In normalised space, dividing the prediction by std saves that (channels,) tensor,
    and the normalised prediction and target exist in forward, their gradients in backward.
    """
    saved = {"l1": pred_bytes, "mse": 2 * pred_bytes, "relative_l2": pred_bytes + 2 * 4 * batch,
             "crps": 3 * pred_bytes}[loss]
    extra = 2 * pred_bytes
    if loss_space == "normalized":
        saved += 4 * channels
        extra += pred_bytes
    return Layer("loss", saved, extra, extra)


# ------------------------------------------------------------------ precision (SwinIR's and the U-Net's)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of the kinds of tensors a training step saves for backward."""

    matmul: int
    """Inputs saved by linear layers, convolutions and attention (the compute dtype)."""
    stream: int
    """The residual stream between Swin blocks, which LayerNorms save (CUDA autocast: fp32)."""
    embed_norm_input: int
    """What the patch-embedding LayerNorm saves of the first convolution's output."""
    weight_copies: bool
    """Autocast saves a low-precision copy of every linear/conv weight it casts."""
    label: str


def precision_for(device_type: str, amp_dtype: str, param_dtype: str = "fp32") -> Precision:
    """How a device and the mixed-precision settings type the saved tensors.

    Autocast on CPU runs LayerNorm and softmax in the low precision (measured); CUDA autocast
    runs LayerNorm in fp32 (its fp32 op list), so the residual stream and LayerNorm inputs stay
    fp32 there. FSDP2 ``param_dtype: bf16`` without autocast computes everything in bf16.
    """
    low = dtype_bytes(amp_dtype if amp_dtype != "none" else param_dtype)
    if low == 4:
        return Precision(4, 4, 4, False, "fp32")
    label = amp_dtype if amp_dtype != "none" else f"{param_dtype} parameters"
    autocast_on = amp_dtype != "none"
    weight_copies = autocast_on and param_dtype == "fp32"  # bf16 parameters need no cast
    if autocast_on and device_type == "cuda":
        return Precision(low, 4, 4, weight_copies, f"{label} autocast (LayerNorm in fp32)")
    return Precision(low, low, low, weight_copies, f"{label} autocast" if autocast_on else label)


# ------------------------------------------------------------------ walking the graph


def held_after_forward(graph: list[Layer]) -> dict[str, float]:
    """Bytes held for backward at the end of forward, by part: checkpointed units keep only their inputs."""
    parts: dict[str, float] = {}
    for op in graph:
        if op.unit is None or op.unit_input:
            parts[op.part] = parts.get(op.part, 0.0) + op.saved
    return parts


def simulate_peak(graph: list[Layer]) -> tuple[float, float]:
    """(peak in forward, peak in backward) of activation memory, walking the graph as autograd does.

    Forward: each layer adds what it saves; a checkpointed unit holds its saved tensors only until
    it ends. Backward, in reverse: entering a checkpointed unit recomputes its forward (its saved
    tensors come back); each layer's backward then frees what it saved. Each moment adds the
    layer's transient tensors.
    """
    held = peak_forward = 0.0
    running_unit, unit_saved = None, 0.0
    for op in graph:
        if op.unit != running_unit:  # the previous unit ended: its saved tensors are dropped
            held -= unit_saved
            running_unit, unit_saved = op.unit, 0.0
        peak_forward = max(peak_forward, held + op.forward_extra)
        held += op.saved
        if op.unit is not None and not op.unit_input:
            unit_saved += op.saved
    held -= unit_saved
    peak_backward = held
    recomputed = set()
    for index in range(len(graph) - 1, -1, -1):
        op = graph[index]
        if op.unit is not None and op.unit not in recomputed:
            recomputed.add(op.unit)
            for other in graph[:index + 1]:  # recompute the unit's forward
                if other.unit == op.unit and not other.unit_input:
                    peak_backward = max(peak_backward, held + other.forward_extra)
                    held += other.saved
        peak_backward = max(peak_backward, held + op.backward_extra)
        held -= op.saved
    return peak_forward, peak_backward

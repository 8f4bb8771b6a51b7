"""Training memory of SwinIR, the ViT forecaster and SC22's 3-D U-Net: an analytic estimate, and the measurements
that check it.

Estimate — :func:`estimate_memory` (what ``estimate_memory.py`` prints) adds up, per rank:

* parameters, gradients and AdamW state (two fp32 moments, a step count per tensor) — exact
  counts from the config;
* activations: the bytes autograd holds for backward at the end of the forward pass (and the
  loss), written out per layer type following SwinIR's structure (``models/swinir.py``): the
  convolution and LayerNorm of the stem, per Swin block LayerNorm → window partition → qkv →
  window attention → proj → residual → LayerNorm → MLP (GELU) → residual, the RSTB convolution,
  the body and the upsampler, and the loss. Windowed attention saves ``heads × window²`` values
  per pixel, so every term is proportional to the number of (padded) pixels: activation memory
  grows linearly with the field, not quadratically as it would with global attention.
  The ViT (``models/vit.py``, :func:`vit_training_graph`): normalisation → patch-embedding
  convolution → + position embedding, per block LayerNorm → q, k, v → SDPA → proj → residual →
  LayerNorm → fc1 → GELU → fc2 → residual, then LayerNorm → head → unpatchify → de-normalisation,
  and the loss (L1, MSE or NERSC's relative L2, in physical or normalised units). Its global
  attention goes through fused SDPA kernels that save q, k, v, the output and a log-sum-exp per
  row — not the tokens × tokens matrix — so it too grows linearly with the tokens.
  SC22's U-Net (``models/unet3d.py``, :func:`unet3d_training_graph`): each convolution saves its input,
  each in-place activation its output (the same tensor as the next convolution's input), the up path
  also the concatenations [upsampled, skip]; tanh its output, L1 the difference. Exact to the byte on
  CPU (fp32, bf16/fp16 autocast, AC none/block, ``lambda_rho``; tests/test_memory.py);
* temporary: the extra memory of the worst moment of the step on top of the held activations.
  The same layer list is walked as autograd walks it (:func:`simulate_peak`): forward adds what
  each layer saves; backward, in reverse, frees it once the layer's backward has run, re-creates
  a checkpointed unit's tensors when backward reaches it, and adds each layer's transient tensors
  (gradients in flight, attention logits and their gradients, the upsampler's high-res gradients).

``total = params + grads + optimizer + activations + temporary``: a slight upper bound on the peak,
since gradients fill up while activations are freed during backward.

Which terms are exact and which approximate, for the models and PyTorch 2.14/2.15 this was written for:

* exact (equal to the byte on CPU in benchmarks/validate_memory_estimate.py; tests/test_memory.py
  asserts the issue's ±15 %): parameters, gradients, optimizer state, and every activation term on
  the CPU path — fp32 and bf16/fp16 autocast, AC none/block/layer, any batch and padding, all
  upsamplers, 1conv/3conv, L1/MSE, stochastic depth. On CPU the model computes window attention
  explicitly (softmax(q kᵀ + bias) v, because the fused CPU kernel cannot return the bias gradient),
  which saves the attention probabilities: ``heads × window²`` values per pixel and block.
  The ViT's activations are exact on CPU to the byte (tests/test_memory.py asserts equality, and
  benchmarks/full_size_memory.py --model vit equality with a FakeTensor trace of vit_base and
  vit_mp at full size): fp32, bf16/fp16 autocast, bf16 parameters, AC none/block, relative L2 / L1
  / MSE in physical or normalised units, stochastic depth, any size and patch. On CPU SDPA runs its
  flash kernel for every dtype (measured), saving q, k, v, the output and an fp32 log-sum-exp
  per head and token. Under autocast the residual stream stays fp32 (the fp32 position embedding
  and residual adds promote the bf16 outputs back), so LayerNorm saves fp32 inputs and q, k and v
  each save their own bf16 cast of its output: three copies (autocast caches only leaf weights).
* modelled, not measured here (no GPU on the machine that wrote this): the CUDA attention path.
  There the model calls ``scaled_dot_product_attention`` with the relative-position bias (+ shift
  mask) as a float mask that needs a gradient, which selects the memory-efficient kernel: it saves
  q, k, v (padded copies when the model pads the head dimension to the kernel's multiple of 8, as
  for the tutorial's 30), the output, the log-sum-exp and the bias itself (materialised per window
  for shifted blocks), not the probabilities; and CUDA autocast runs LayerNorm in fp32, so the residual stream
  stays fp32. ``benchmarks/validate_memory_estimate.py`` on a GPU checks this path. For the ViT:
  flash attention for fp16/bf16 (the same saved tensors as the CPU kernel, and two RNG-state
  scalars, not counted), the memory-efficient kernel for fp32 (log-sum-exp padded to 32 rows),
  the math fallback (which saves the tokens × tokens probabilities) only for head_dim % 8 != 0;
  CUDA autocast's fp32 LayerNorm changes nothing there, the stream being fp32 already.
* approximate: the temporary peak (which transients coexist is reasoned, not traced; on CPU the
  predicted total was within a few % of the measured peak for fp32/bf16), and the FSDP
  all-gather buffers (two units in flight plus the root's parameters). The total is an upper
  bound because it counts all gradients; on small inputs, where gradients weigh more, it
  over-predicts by up to ~15 %. The ViT's total over-predicted the measured CPU peak by +10 to
  +24 % on the small models of validate_memory_estimate.py and bench_vit.py (22M parameters on a
  96x192 field) and by +4 to +11 % where activations weigh more: without AC its peak is at the end
  of forward, before any gradient exists, so the excess is about the gradients (vit_mp's 1.4 GB
  are ~3 % of its 56 GB per GPU). Not modelled: kernel workspaces — e.g. fp16 on CPU, where
  convolutions fall back to an im2col kernel whose buffers add ~20 % to the peak (fp16 is for GPUs;
  use bf16 on CPU).

Measure — the same quantities on any device, without trusting the estimate:

* :class:`SavedTensorBytes` counts the bytes autograd saves for backward through
  ``torch.autograd.graph.saved_tensors_hooks``, once per storage (views and repeated saves of one
  tensor share storage), leaving out parameters and buffers. It also sees the inputs that
  non-reentrant activation checkpointing keeps.
* :func:`measure_training_memory` runs a real training step and returns parameters, gradients,
  optimizer state, saved activations and the peak: ``torch.cuda.max_memory_allocated`` on CUDA;
  on CPU the allocation trace of ``torch.profiler`` (``profile_memory=True``: every allocation and
  free, summed in time order), which gives the same peak above the step's start.
* :func:`trace_saved_activations` counts the saved bytes of one forward pass under
  ``FakeTensorMode``: the same operators dispatch and save the same tensors (shapes and dtypes),
  but nothing is computed or allocated, so the whole 720×1440 field in fp32 without checkpointing
  can be "measured" on a laptop. Small sizes check that it equals the real count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from utils.config import Config, ConfigError
from utils.parallel.domain_parallel import band_bounds

GB = 1e9  # decimal gigabytes, as utils.observe.flops.peak_memory_gb and nvidia-smi's "GB"
ERA5_FIELD = (720, 1440)  # SuperBench's 721 x 1440 with the last latitude row dropped
NUM_FEAT = 64  # width of SwinIR's reconstruction convolutions (models/swinir.py)
LN_STATS_BYTES = 8  # LayerNorm keeps mean and 1/std per token, in fp32 even for bf16 inputs
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 per parameter
ADAMW_STEP_BYTES = 4  # and one fp32 step count per parameter tensor
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CONV_PARTS = ("stem", "rstb_convs", "body", "upsampler")  # SwinIR's parts around its 3x3 convolutions


# =============================================================================================
# The model's shape, from the config
# =============================================================================================


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
    low = DTYPE_BYTES[amp_dtype if amp_dtype != "none" else param_dtype]
    if low == 4:
        return Precision(4, 4, 4, False, "fp32")
    label = amp_dtype if amp_dtype != "none" else f"{param_dtype} parameters"
    autocast_on = amp_dtype != "none"
    weight_copies = autocast_on and param_dtype == "fp32"  # bf16 parameters need no cast
    if autocast_on and device_type == "cuda":
        return Precision(low, 4, 4, weight_copies, f"{label} autocast (LayerNorm in fp32)")
    return Precision(low, low, low, weight_copies, f"{label} autocast" if autocast_on else label)


def _conv(cin: int, cout: int, k: int = 3) -> tuple[int, int]:
    """(weights that autocast casts, all parameters) of a conv or linear layer with bias."""
    return cin * cout * k * k, cin * cout * k * k + cout


def _add(*parts: tuple[int, int]) -> tuple[int, int]:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


@dataclass(frozen=True)
class SwinIRShape:
    """What the memory of SwinIR depends on, read from the config's model section."""

    in_chans: int
    embed_dim: int
    hidden: int
    depths: tuple[int, ...]
    num_heads: tuple[int, ...]
    window: int
    """Attention window side of the blocks (the model shrinks it when img_size <= window_size)."""
    pad_multiple: int
    """Inputs are padded to a multiple of the configured window_size."""
    upscale: int
    upsampler: str
    resi_connection: str
    qkv_bias: bool
    drop_path_rate: float

    @classmethod
    def from_config(cls, m) -> "SwinIRShape":
        side = min(m.img_hw)
        window = m.window_size if side > m.window_size else side
        return cls(m.in_chans, m.embed_dim, int(m.embed_dim * m.mlp_ratio), tuple(m.depths), tuple(m.num_heads),
                   window, m.window_size, m.upscale, m.upsampler, m.resi_connection, m.qkv_bias, m.drop_path_rate)

    @property
    def scale(self) -> int:
        return self.upscale if self.upsampler else 1

    @property
    def num_blocks(self) -> int:
        return sum(self.depths)

    def shifted(self, index_in_layer: int) -> bool:
        """Every second block shifts its windows (unless the window was shrunk to img_size)."""
        return index_in_layer % 2 == 1 and self.window == self.pad_multiple

    # ------------------------------------------------------------------ parameters (exact)

    def _resi(self) -> tuple[int, int]:
        c = self.embed_dim
        if self.resi_connection == "1conv":
            return _conv(c, c)
        return _add(_conv(c, c // 4), _conv(c // 4, c // 4, 1), _conv(c // 4, c))

    def block_params(self, heads: int) -> tuple[int, int]:
        c, h = self.embed_dim, self.hidden
        qkv = (3 * c * c, 3 * c * c + (3 * c if self.qkv_bias else 0))
        table = (2 * self.window - 1) ** 2 * heads
        norms = 4 * c
        matmul, other = _add(qkv, _conv(c, c, 1), _conv(c, h, 1), _conv(h, c, 1))
        return matmul, other + table + norms

    def rstb_conv_params(self) -> tuple[int, int]:
        return self._resi()

    def stem_params(self) -> tuple[int, int]:
        w, total = _conv(self.in_chans, self.embed_dim)
        return w, total + 2 * self.embed_dim  # + patch-embedding LayerNorm

    def body_params(self) -> tuple[int, int]:
        w, total = self._resi()
        return w, total + 2 * self.embed_dim  # + final LayerNorm

    def head_params(self) -> tuple[int, int]:
        c, f, out, s = self.embed_dim, NUM_FEAT, self.in_chans, self.upscale
        if self.upsampler == "pixelshuffle":
            stages = [_conv(f, 4 * f)] * int(math.log2(s)) if s & (s - 1) == 0 else [_conv(f, 9 * f)]
            return _add(_conv(c, f), *stages, _conv(f, out))
        if self.upsampler == "pixelshuffledirect":
            return _conv(c, s * s * out)
        if self.upsampler == "nearest+conv":
            ups = [_conv(f, f)] * (2 if s == 4 else 1)
            return _add(_conv(c, f), *ups, _conv(f, f), _conv(f, out))
        return _conv(c, out)

    def num_params(self) -> int:
        blocks = sum(d * self.block_params(h)[1] for d, h in zip(self.depths, self.num_heads))
        rstb = len(self.depths) * self.rstb_conv_params()[1]
        return self.stem_params()[1] + blocks + rstb + self.body_params()[1] + self.head_params()[1]

    def num_param_tensors(self) -> int:
        """Parameter tensors (weights, biases, LayerNorm pairs, bias tables): AdamW keeps a step count each."""
        convs = {"1conv": 1, "3conv": 3}[self.resi_connection]
        head = {"pixelshuffle": 2 + (int(math.log2(self.upscale)) if self.upscale & (self.upscale - 1) == 0 else 1),
                "pixelshuffledirect": 1, "nearest+conv": 3 + (2 if self.upscale == 4 else 1), "": 1}[self.upsampler]
        per_block = 12 + self.qkv_bias  # 2 LayerNorms x 2, qkv, bias table, proj x 2, fc1 x 2, fc2 x 2
        tensors = 2 * (1 + 1 + 1)  # conv_first, patch-embedding LayerNorm, final LayerNorm
        tensors += self.num_blocks * per_block + 2 * convs * (len(self.depths) + 1) + 2 * head
        return tensors

    name = "SwinIR"

    def check_supported(self, ac: str = "none", fsdp_unit: str = "block") -> None:
        s = self.upscale
        if self.upsampler == "pixelshuffle" and not (s & (s - 1) == 0 or s == 3):
            raise ConfigError(f"upscale {s} is not supported by upsampler 'pixelshuffle': use 2^n or 3")
        if self.upsampler == "nearest+conv" and s not in (2, 4):
            raise ConfigError(f"upscale {s} is not supported by upsampler 'nearest+conv': use 2 or 4")

    def fsdp_units(self, unit: str) -> list[int]:
        """Parameters of each FSDP unit: every Swin block, or every RSTB (its blocks and convolution)."""
        if unit == "block":
            return [self.block_params(h)[1] for d, h in zip(self.depths, self.num_heads) for _ in range(d)]
        return [sum(self.block_params(h)[1] for _ in range(d)) + self.rstb_conv_params()[1]
                for d, h in zip(self.depths, self.num_heads)]

    def cast_weights(self, ac: str) -> int:
        """Linear/conv weights whose autocast copies stay saved: those used outside checkpointed units."""
        block_w = sum(d_ * self.block_params(h)[0] for d_, h in zip(self.depths, self.num_heads))
        rstb_w = len(self.depths) * self.rstb_conv_params()[0]
        outside_ac = self.stem_params()[0] + self.body_params()[0] + self.head_params()[0]
        return outside_ac + {"none": block_w + rstb_w, "block": rstb_w, "layer": 0}[ac]


@dataclass(frozen=True)
class ViTShape:
    """What the memory of the ViT forecaster depends on (models/vit.py), read from the config's model section."""

    in_chans: int
    img_size: tuple[int, int]
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    hidden: int
    qkv_bias: bool
    drop_path_rate: float

    @classmethod
    def from_config(cls, m) -> "ViTShape":
        return cls(m.in_chans, m.img_hw, m.patch_size, m.embed_dim, m.depths[0], m.num_heads[0],
                   int(m.embed_dim * m.mlp_ratio), m.qkv_bias, m.drop_path_rate)

    name = "ViT"

    @property
    def tokens(self) -> int:
        """Tokens per sample: one per patch of the whole field."""
        return (self.img_size[0] // self.patch_size) * (self.img_size[1] // self.patch_size)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    # ------------------------------------------------------------------ parameters (exact)

    def block_params(self) -> tuple[int, int]:
        """(weights that autocast casts, all parameters) of one transformer block."""
        d, h = self.embed_dim, self.hidden
        qkv = (3 * d * d, 3 * d * d + (3 * d if self.qkv_bias else 0))
        matmul, total = _add(qkv, _conv(d, d, 1), _conv(d, h, 1), _conv(h, d, 1))
        return matmul, total + 4 * d  # + norm1, norm2

    def stem_params(self) -> tuple[int, int]:
        """Patch-embedding convolution and the position embedding (added, not cast)."""
        w, total = _conv(self.in_chans, self.embed_dim, self.patch_size)
        return w, total + self.tokens * self.embed_dim

    def end_params(self) -> tuple[int, int]:
        """Final LayerNorm and the head (no bias)."""
        w = self.embed_dim * self.in_chans * self.patch_size ** 2
        return w, w + 2 * self.embed_dim

    def num_params(self) -> int:
        return self.stem_params()[1] + self.depth * self.block_params()[1] + self.end_params()[1]

    def num_param_tensors(self) -> int:
        """AdamW keeps a step count per tensor: conv 2, pos_embed 1, final norm 2, head 1; per block
        2 LayerNorms x 2, q/k/v weights (and biases), proj, fc1, fc2 x 2."""
        return 6 + self.depth * (10 + 3 * (1 + self.qkv_bias))

    def fsdp_units(self, unit: str) -> list[int]:
        """Parameters of each FSDP unit: every transformer block (the root keeps the rest)."""
        return [self.block_params()[1]] * self.depth

    def cast_weights(self, ac: str) -> int:
        """Linear/conv weights whose autocast copies stay saved: those used outside checkpointed blocks."""
        outside = self.stem_params()[0] + self.end_params()[0]
        return outside + (self.depth * self.block_params()[0] if ac == "none" else 0)

    def check_supported(self, ac: str = "none", fsdp_unit: str = "block") -> None:
        if ac == "layer":
            raise ConfigError("ac 'layer' checkpoints SwinIR's RSTBs; the ViT has one stage: use ac block or none")
        if fsdp_unit == "layer":
            raise ConfigError("fsdp_unit 'layer' shards SwinIR's RSTBs; the ViT's FSDP unit is the block")


@dataclass(frozen=True)
class UNet3DShape:
    """What the memory of SC22's 3-D U-Net depends on (models/unet3d.py), read from the config's model section."""

    in_chans: int
    out_chans: int
    widths: tuple[int, ...]
    """Channels of every level of the down path, the full_scale level included."""

    @classmethod
    def from_config(cls, m) -> "UNet3DShape":
        return cls(m.in_chans, m.out_chans, tuple(m.widths) + ((m.widths[-1],) if m.full_scale else ()))

    name = "U-Net"

    @property
    def levels(self) -> int:
        return len(self.widths)

    def convolutions(self) -> list[tuple[int, int]]:
        """(input, output) channels of every convolution in forward order: the down blocks, the up blocks
        (from the second on, their input is the previous output concatenated with the skip: twice the width)
        and the last transposed convolution."""
        w = self.widths
        down = list(zip((self.in_chans, *w[:-1]), w))
        up = [(w[i] * (1 if i == len(w) - 1 else 2), w[i - 1]) for i in range(len(w) - 1, 0, -1)]
        return down + up + [(2 * w[0], self.out_chans)]

    # ------------------------------------------------------------------ parameters (exact)

    def conv_params(self) -> list[tuple[int, int]]:
        """(weights that autocast casts, all parameters) of each convolution (kernel 4³, with bias)."""
        return [(64 * c_in * c_out, 64 * c_in * c_out + c_out) for c_in, c_out in self.convolutions()]

    def num_params(self) -> int:
        return sum(total for _, total in self.conv_params())

    def num_param_tensors(self) -> int:
        return 2 * len(self.conv_params())

    def fsdp_units(self, unit: str) -> list[int]:
        """Parameters of each FSDP unit: every down and up block (the root keeps the last convolution)."""
        return [total for _, total in self.conv_params()[:-1]]

    def cast_weights(self, ac: str) -> int:
        """Conv weights whose autocast copies stay saved: those used outside checkpointed blocks."""
        weights = [w for w, _ in self.conv_params()]
        return weights[-1] + (sum(weights[:-1]) if ac == "none" else 0)

    def check_supported(self, ac: str = "none", fsdp_unit: str = "block") -> None:
        if "layer" in (ac, fsdp_unit):
            raise ConfigError("ac/fsdp_unit 'layer' is SwinIR's RSTB; the U-Net's unit is its block (each level's "
                              "convolution): use block")


# =============================================================================================
# Input geometry
# =============================================================================================


def field_size_of(cfg: Config) -> tuple[tuple[int, int], str]:
    """High-res whole-field size when crop_size is 0, and where it came from: the data's grid if
    the training split exists, else ERA5's 720 x 1440."""
    from utils.data.common import DataError
    from utils.data.era5 import scan_split

    split = Path(cfg.data.data_dir) / cfg.data.train_split
    try:
        first = scan_split(split)[0]
    except DataError:
        return ERA5_FIELD, f"ERA5's grid ({split} has no data; --field HxW sets another)"
    return (first.height - 1, first.width), f"the grid of {first.path}"  # the dataset drops the last row


def lr_input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """Height and width of the model's input: the low-res crop, or the low-res whole field."""
    hr = (cfg.data.crop_size, cfg.data.crop_size) if cfg.data.crop_size else (field or field_size_of(cfg)[0])
    if cfg.data.task == "forecast":
        return hr
    s = cfg.model.upscale
    if hr[0] % s or hr[1] % s:
        raise ConfigError(f"the high-res size {hr[0]}x{hr[1]} is not divisible by upscale {s}")
    return hr[0] // s, hr[1] // s


# =============================================================================================
# The estimate
# =============================================================================================


@dataclass
class MemoryEstimate:
    """Predicted training memory of one rank, in bytes (``to_json`` gives GB)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    temporary: float
    activations_by_part: dict[str, float]
    temporary_by_phase: dict[str, float]
    params_detail: dict[str, float]
    setting: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporary

    def to_json(self) -> dict:
        gb = lambda value: round(value / GB, 6)  # noqa: E731
        return {
            "params_gb": gb(self.params), "grads_gb": gb(self.grads), "optimizer_gb": gb(self.optimizer),
            "activations_gb": gb(self.activations), "temporary_gb": gb(self.temporary), "total_gb": gb(self.total),
            "activations_by_part_gb": {k: gb(v) for k, v in self.activations_by_part.items()},
            "temporary_by_phase_gb": {k: gb(v) for k, v in self.temporary_by_phase.items()},
            "params_detail_gb": {k: gb(v) for k, v in self.params_detail.items()},
            **self.setting,
        }


def attention_kernel(device_type: str) -> str:
    """Which attention the model runs in training: see WindowAttention.forward."""
    return "explicit" if device_type == "cpu" else "sdpa"


@dataclass
class Layer:
    """One operation of the training graph, in forward order, for the memory bookkeeping (bytes)."""

    part: str
    """Category it is reported under (stem, swin_blocks, rstb_convs, body, upsampler, loss)."""
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


def _swin_block(shape: SwinIRShape, heads: int, p: Precision, kernel: str, shifted: bool, tokens: int,
                batch: int, drop_path: bool) -> list[Layer]:
    """The saved tensors of one Swin block (models/swinir.py: SwinTransformerBlock._forward)."""
    c, hid, n, a, st = shape.embed_dim, shape.hidden, shape.window ** 2, p.matmul, p.stream
    att = heads * n * a  # one attention matrix: heads x window^2 values per token
    skips = c * a + 2 * c * st  # gradients waiting at the long, RSTB and block skip connections
    t = tokens

    def layer(saved, fwd=0.0, bwd=0.0):
        return Layer("swin_blocks", t * saved, t * fwd, t * (bwd + skips))

    layers = [Layer("swin_blocks", t * c * st, unit_input=True),           # block input, saved by norm1
              layer(LN_STATS_BYTES, c * a, c * a + c * st)]                 # norm1 (statistics)
    if kernel == "explicit":
        layers += [
            layer(c * a, 3 * c * a, 5 * c * a),                 # qkv: its input, the norm1 output in windows
            layer(2 * c * a, 3 * c * a + att, att + 2 * c * a),  # q k^T: scaled q, contiguous copy of k^T
            layer(att, 3 * c * a + 2 * att, 2 * att + c * a),    # softmax: the probabilities
            layer(c * a, c * a, att + 2 * c * a),                # probs @ v: contiguous copy of v
            layer(c * a, c * a, 2 * c * a),                      # proj: its input
        ]
    else:
        # Memory-efficient SDPA keeps q, k, v, its output, the fp32 log-sum-exp and the bias + mask,
        # which shifted blocks materialise per window. q, k, v are views of the qkv output and the
        # output is proj's input, unless the model pads the head dimension for the kernel: then
        # they are padded copies, and proj's input is a copy of the output's unpadded part.
        head_dim = c // heads
        padded = heads * (head_dim + _sdpa_head_pad(head_dim))
        qkv_out = 3 * padded * a + padded * a + (c * a if padded != c else 0.0)
        bias_per_token = att if shifted else 0.0
        layers += [
            layer(c * a, 3 * c * a, 5 * c * a),
            layer(qkv_out + 4 * heads + bias_per_token, padded * a + bias_per_token, 4 * padded * a + att),
        ]
        if not shifted:  # one (heads, N, N) bias shared by all windows
            layers[-1].saved += heads * n * n * a
    layers += [
        layer(c * st + LN_STATS_BYTES, c * a, c * a + c * st),  # norm2: the mid-block residual, statistics
        layer(c * a, hid * a, hid * a + c * a),                 # fc1: its input
        layer(hid * a, hid * a, 2 * hid * a),                   # GELU: its input
        layer(hid * a, c * a, c * a + hid * a),                 # fc2: its input
    ]
    if drop_path:  # DropPath saves its (batch, 1, 1) keep-mask, after attention and after the MLP
        layers[-1].saved += 2 * batch * a
    return layers


def _sdpa_head_pad(head_dim: int) -> int:
    """Channels the model adds to each CUDA attention head for the fused kernel (models/swinir.py)."""
    import models.swinir as swinir

    multiple = getattr(swinir, "SDPA_HEAD_DIM_MULTIPLE", {}).get("cuda", 1)
    return -head_dim % multiple


def _resi_conv(shape: SwinIRShape, a: int) -> float:
    """RSTB / body convolution saves its input (3conv: also two in-place LeakyReLU outputs), per token."""
    c = shape.embed_dim
    return c * a if shape.resi_connection == "1conv" else (c + 2 * (c // 4)) * a


def _upsampler(shape: SwinIRShape, a: int, tokens: int) -> list[Layer]:
    """The reconstruction head's saved tensors: conv inputs; in-place LeakyReLUs save their outputs."""
    c, f, s, out, t = shape.embed_dim, NUM_FEAT, shape.upscale, shape.in_chans, tokens

    def layer(saved, fwd=0.0, bwd=0.0):
        return Layer("upsampler", t * saved, t * fwd, t * bwd)

    if shape.upsampler == "pixelshuffle":
        # conv + LeakyReLU (in place), then per stage conv -> PixelShuffle, then conv_last.
        factors = [4 ** k for k in range(1, int(math.log2(s)) + 1)] if s & (s - 1) == 0 else [9]
        layers = [layer(c * a, f * a, f * a + c * a), layer(f * a, 0, 2 * f * a)]
        previous = 1
        for factor in factors:  # the stage's conv input is the previous output (saved by its holder)
            layers.append(layer(0 if previous == 1 else f * previous * a, 2 * f * factor * a,
                                f * factor * a + f * previous * a))
            previous = factor
        layers.append(layer(f * s * s * a, out * s * s * a, out * s * s * a + f * s * s * a))  # conv_last
        return layers
    if shape.upsampler == "pixelshuffledirect":
        return [layer(c * a, out * s * s * a, out * s * s * a + c * a)]
    if shape.upsampler == "nearest+conv":
        layers = [layer(c * a, f * a, f * a + c * a), layer(f * a, 0, 2 * f * a)]
        for factor in [4 ** k for k in range(1, (2 if s == 4 else 1) + 1)]:
            # conv on the interpolated map (its input saved), LeakyReLU in place (its output saved)
            layers += [layer(f * factor * a, 2 * f * factor * a, 2 * f * factor * a), layer(f * factor * a, 0, 2 * f * factor * a)]
        layers += [layer(0, f * s * s * a, 2 * f * s * s * a), layer(f * s * s * a, 0, 2 * f * s * s * a),
                   layer(0, out * s * s * a, out * s * s * a + f * s * s * a)]  # conv_hr, LeakyReLU, conv_last
        return layers
    return [layer(c * a, out * a, out * a + c * a)]  # no upsampling: conv_last


def training_graph(shape: SwinIRShape, p: Precision, kernel: str, ac: str, batch: int, padded: tuple[int, int],
                   out_pixels: int, loss: str, loss_space: str = "physical") -> list[Layer]:
    """SwinIR's training step as a list of layers in forward order (models/swinir.py: SwinIR.forward)."""
    c, a, st = shape.embed_dim, p.matmul, p.stream
    tokens = batch * padded[0] * padded[1]
    graph = [Layer("stem", tokens * shape.in_chans * a, tokens * c * a),                 # conv_first: its input
             Layer("stem", tokens * (c * p.embed_norm_input + LN_STATS_BYTES),           # patch-embedding norm
                   tokens * c * st, tokens * (c * st + c * a))]
    unit = 0
    block_index = 0
    for layer_index, (depth, heads) in enumerate(zip(shape.depths, shape.num_heads)):
        for i in range(depth):
            block = _swin_block(shape, heads, p, kernel, shape.shifted(i), tokens, batch,
                                drop_path=shape.drop_path_rate > 0 and block_index > 0)  # rates linspace(0, r)
            block_index += 1
            for op in block:
                op.unit = {"none": None, "block": unit, "layer": layer_index}[ac]
                op.unit_input = op.unit_input and (ac == "block" or (ac == "layer" and i == 0))
            unit += 1
            graph += block
        conv = Layer("rstb_convs", tokens * _resi_conv(shape, a), tokens * c * a,
                     tokens * (2 * c * a + c * st + c * a), unit=layer_index if ac == "layer" else None)
        graph.append(conv)
    graph += [Layer("body", tokens * (c * st + LN_STATS_BYTES), tokens * c * a, tokens * 3 * c * a),  # norm
              Layer("body", tokens * _resi_conv(shape, a), tokens * c * a, tokens * 3 * c * a)]   # conv_after_body
    graph += _upsampler(shape, a, tokens)
    # The cropped fp32 prediction and the loss's intermediate exist in forward; their gradients in backward.
    graph.append(loss_layer(loss, loss_space, out_pixels * shape.in_chans * 4, batch, shape.in_chans))
    return graph


# ------------------------------------------------------------------ the ViT (models/vit.py)


@dataclass(frozen=True)
class ViTPrecision:
    """Bytes per element of the tensors the ViT's training step saves."""

    matmul: int
    """Linear/conv inputs, SDPA's q, k, v and output, the MLP's hidden activations (the compute dtype)."""
    stream: int
    """The residual stream: the parameters' dtype, since adding the fp32 position embedding to the
    autocast conv output (and the blocks' outputs to it) promotes back to it."""
    norm: int
    """LayerNorm's saved input and its output: CUDA autocast runs it in fp32, elsewhere the stream's dtype."""
    weight_copies: bool
    """Autocast saves a low-precision copy of every linear/conv weight it casts."""
    label: str
    stats: int = LN_STATS_BYTES
    """LayerNorm's mean and 1/std per token: fp32, except on CPU with bf16 weights (then bf16, measured)."""


def vit_precision(device_type: str, amp_dtype: str, param_dtype: str = "fp32") -> ViTPrecision:
    """How a device and the mixed-precision settings type the ViT's saved tensors (measured on CPU)."""
    param = DTYPE_BYTES[param_dtype]
    autocast_on = amp_dtype != "none"
    low = DTYPE_BYTES[amp_dtype] if autocast_on else param
    if low == 4:
        return ViTPrecision(4, 4, 4, False, "fp32")
    label = amp_dtype if autocast_on else f"{param_dtype} parameters"
    if autocast_on and device_type == "cuda":
        return ViTPrecision(low, param, 4, param == 4, f"{label} autocast (LayerNorm in fp32)")
    stream_note = ", fp32 residual stream" if param == 4 else ""
    stats = LN_STATS_BYTES if device_type == "cuda" or param == 4 else 2 * param
    return ViTPrecision(low, param, param, autocast_on and param == 4,
                        f"{label} autocast{stream_note}" if autocast_on else label, stats)


def vit_attention_kernel(device_type: str, p: ViTPrecision, head_dim: int) -> str:
    """Which SDPA backend trains the ViT (no mask, no dropout).

    CPU: the flash kernel for every dtype (measured: ScaledDotProductFlashAttentionForCpuBackward).
    CUDA: flash for fp16/bf16 with head_dim a multiple of 8 up to 256; the memory-efficient kernel
    for fp32; the math fallback (which saves the attention matrix) otherwise.
    """
    if device_type == "cpu":
        return "flash (CPU)"
    if head_dim % 8:
        return "math"
    return "flash" if p.matmul == 2 and head_dim <= 256 else "efficient"


def loss_layer(loss: str, loss_space: str, pred_bytes: float, batch: int, channels: int) -> Layer:
    """The loss on the fp32 prediction (``pred_bytes`` = one fp32 copy of the predicted batch).

    L1 saves pred - target (for |.|'s gradient); MSE saves prediction and target; relative L2 saves
    pred - target and the fp32 norms per sample (of the difference, and of the target for the
    division). In normalised space, dividing the prediction by std saves that (channels,) tensor,
    and the normalised prediction and target exist in forward, their gradients in backward.
    """
    saved = {"l1": pred_bytes, "mse": 2 * pred_bytes, "relative_l2": pred_bytes + 2 * 4 * batch}[loss]
    extra = 2 * pred_bytes
    if loss_space == "normalized":
        saved += 4 * channels
        extra += pred_bytes
    return Layer("loss", saved, extra, extra)


def vit_training_graph(shape: ViTShape, p: ViTPrecision, kernel: str, ac: str, batch: int, loss: str,
                       loss_space: str) -> list[Layer]:
    """The ViT's training step as a list of layers in forward order (models/vit.py: ViT.forward).

    Per token and block, fp32: the block input (saved by norm1), LayerNorm statistics, norm1's
    output (shared by q, k and v), q, k, v and the SDPA output (proj's input: a view), the
    log-sum-exp, the mid-block residual (norm2), norm2's output, fc1's output (GELU's input) and
    GELU's output (fc2's input): 16 x D fp32 values + 8 + 4 x heads bytes. Under autocast with fp32
    parameters, q, k and v each cast the LayerNorm output again (three copies, not one: autocast
    caches only leaf weights) and the stream stays fp32.
    """
    d, hid, a, st, ln = shape.embed_dim, shape.hidden, p.matmul, p.stream, p.norm
    tokens = shape.tokens
    t = batch * tokens
    field = batch * shape.in_chans * shape.img_size[0] * shape.img_size[1]  # values in a batch of fields
    casts = 1 if ln == a else 3  # copies of the LayerNorm output that q, k, v save as their input
    skip = t * d * st  # the residual stream's gradient, waiting while a branch's backward runs
    if kernel == "math":  # scaled q and k, v, the probabilities; proj's input is a copy of the output
        attention = t * 4 * d * a + batch * shape.num_heads * tokens * tokens * a
    else:  # q, k, v, the output (proj's input is a view of it) and the fp32 log-sum-exp
        lse = tokens if kernel != "efficient" else math.ceil(tokens / 32) * 32  # padded to 32 rows
        attention = t * 4 * d * a + batch * shape.num_heads * lse * 4

    graph = [  # patch embedding: the convolution saves its (normalised, cast) input; + position embedding
        Layer("patch_embed", field * a, t * d * a + field * 4, t * d * a + skip),
        Layer("patch_embed", 0.0, skip, 2 * skip),
    ]
    for i in range(shape.depth):
        unit = i if ac == "block" else None
        drop_path = shape.drop_path_rate > 0 and i > 0  # rates linspace(0, r): block 0 has none
        block = [
            # the block input: held by checkpointing, else saved by norm1 (unless it saves an fp32 copy)
            Layer("blocks", t * d * st if ac == "block" or ln == st else 0.0, unit_input=True),
            Layer("blocks", t * (p.stats + (d * ln if ln != st else 0)),         # norm1
                  t * d * ln, t * d * (2 * ln + st) + skip),
            Layer("blocks", t * casts * d * a, t * 3 * d * a, t * (3 * d * a + d * a + 2 * d * ln) + skip),  # q, k, v
            Layer("blocks", attention, t * d * a, t * 4 * d * a + skip),                 # SDPA
            Layer("blocks", 2 * batch * a if drop_path else 0.0, t * d * a, 2 * t * d * a + skip),  # proj, residual
            Layer("blocks", t * (d * ln + p.stats), t * d * (st + ln), t * d * (a + 2 * ln + st) + skip),  # norm2
            Layer("blocks", t * d * a, t * hid * a, t * (hid + d) * a + skip),           # fc1: its (cast) input
            Layer("blocks", t * hid * a, t * hid * a, 2 * t * hid * a + skip),           # GELU: its input
            Layer("blocks", t * hid * a, t * d * a, t * (hid + d) * a + skip),           # fc2: its input
        ]
        for op in block:
            op.unit = unit
            op.unit_input = op.unit_input and ac == "block"
        graph += block
    graph += [  # final norm (input, statistics), head (its input); unpatchify and de-normalisation save nothing
        Layer("head", t * (d * ln + p.stats), t * d * ln, t * d * (a + 2 * ln) + skip),
        Layer("head", t * d * a, 2 * field * a + 2 * field * 4, 2 * field * a + 2 * field * 4),
        loss_layer(loss, loss_space, field * 4, batch, shape.in_chans),
    ]
    return graph


# ------------------------------------------------------------------ SC22's 3-D U-Net (models/unet3d.py)


def unet3d_training_graph(shape: UNet3DShape, a: int, input_held: int, ac: str, batch: int, side: int,
                          lambda_rho: float = 0.0) -> list[Layer]:
    """The U-Net's training step as a list of layers in forward order (models/unet3d.py: UNet3D.forward).

    Every convolution saves its input (in the compute dtype ``a``: under autocast the first one saves a
    cast copy of the fp32 input), and every activation works in place and saves its output, which is also
    the next convolution's input: one tensor per level of the down path. The up path saves each block's
    ReLU output and the concatenation [upsampled, skip] that the next block (or the last convolution) takes;
    tanh saves its output, L1 the fp32 difference. With ``ac: block`` each down and up block keeps only its
    input (``input_held`` bytes per value for the fp32 input of the first) and the concatenations, made
    outside the blocks, stay.
    """
    w, levels = shape.widths, shape.levels
    voxels = [batch * (side >> (k + 1)) ** 3 for k in range(levels)]  # per sample and channel, level k
    full = batch * side ** 3
    out = [voxels[k] * w[k] * a for k in range(levels)]  # each down block's output
    checkpointed = ac == "block"
    graph = []
    for k in range(levels):
        unit = k if checkpointed else None
        if k == 0:  # the input: kept by the checkpoint as given, else saved by the convolution (a cast copy)
            given = full * shape.in_chans
            graph.append(Layer("down", given * (input_held if checkpointed else a), 0.0, 0.0, unit, checkpointed))
            if checkpointed and input_held != a:  # inside the block: the convolution's cast copy
                graph.append(Layer("down", given * a, given * a, given * a, unit))
        elif checkpointed:  # the previous block's output, kept as this block's input
            graph.append(Layer("down", out[k - 1], 0.0, 0.0, unit, True))
        graph.append(Layer("down", out[k], out[k], 2 * out[k] + (out[k - 1] if k else 0.0), unit))  # conv, LeakyReLU
    for j, k in enumerate(range(levels - 2, -1, -1)):  # up block j makes level k
        unit = levels + j if checkpointed else None
        if j == 0 and checkpointed:  # the deepest output, kept as the first up block's input
            graph.append(Layer("up", out[levels - 1], 0.0, 0.0, unit, True))
        given = out[k + 1] if j == 0 else voxels[k + 1] * 2 * w[k + 1] * a
        relu = voxels[k] * w[k] * a
        graph += [
            Layer("up", relu, relu, given + 2 * relu, unit),                   # ConvTranspose + ReLU: its output
            Layer("up", 2 * relu, 2 * relu, 4 * relu),                         # [upsampled, skip]: a new tensor
        ]
    prediction = full * shape.out_chans
    graph += [
        Layer("last", prediction * a, prediction * a, prediction * a + voxels[0] * 2 * w[0] * a),  # ConvTranspose, tanh
        loss_layer("l1", "physical", prediction * 4, batch, shape.out_chans),
    ]
    if lambda_rho:  # exp(14 x) of the predicted density saves its output, its L1 the difference
        graph[-1].saved += 2 * full * 4
    return graph


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


SHAPES = {"swinir": SwinIRShape, "vit": ViTShape, "unet3d": UNet3DShape}


def model_shape(model_cfg) -> "SwinIRShape | ViTShape | UNet3DShape":
    """The shape the estimate needs of the config's model (``model: swinir``, ``vit`` or ``unet3d``)."""
    return SHAPES[model_cfg.model].from_config(model_cfg)


def input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, ...]:
    """Spatial size of the model's input: the ViT's img_size (its only size), SwinIR's low-res input, the
    U-Net's crop (side, side, side)."""
    if cfg.model.model == "vit":
        return cfg.model.img_hw
    if cfg.model.model == "unet3d":
        return (cfg.data.crop_size,) * 3
    return lr_input_size(cfg, field)


def estimate_memory(cfg: Config, world_size: int = 1, strategy: str = "none", device_type: Optional[str] = None,
                    field: Optional[tuple[int, int]] = None, lr_size: Optional[tuple[int, int]] = None) -> MemoryEstimate:
    """Predicted peak training memory of one rank for a config (see the module docstring).

    ``strategy``: "none" (one device, train.py), "ddp" or "fsdp" over ``world_size`` ranks; the
    config's batch_size is global, so each rank holds the activations of batch_size / world_size.
    ``device_type`` picks the attention path (default: cfg.train.device, "auto" = CUDA if present).
    ``lr_size`` overrides SwinIR's input size (else it follows crop_size, or the whole ``field``);
    the ViT's input is always its img_size (its position embedding is made for it).
    """
    if strategy not in ("none", "ddp", "fsdp"):
        raise ConfigError(f"strategy {strategy!r} is not one of none, ddp, fsdp")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if strategy == "none" and world_size != 1:
        raise ConfigError(f"world_size {world_size} needs --strategy ddp or fsdp")
    if cfg.model.model == "swinir" and cfg.dist.cp > 1 and strategy != "fsdp":
        raise ConfigError("cp > 1 is train_mp.py's domain parallelism, sharded with FSDP2 over dp x cp: use --strategy fsdp "
                          "with --world_size a multiple of cp")
    cp = cfg.dist.cp if cfg.model.model == "swinir" else 1  # SwinIR's cp: bands of each field (domain parallelism)
    if world_size % cp:
        raise ConfigError(f"world_size {world_size} is not a multiple of cp {cp}: each field is split over cp ranks")
    if cfg.train.batch_size % (world_size // cp):
        raise ConfigError(f"batch_size {cfg.train.batch_size} is the global batch and must be divisible by the "
                          f"{world_size // cp} data-parallel ranks; use a multiple of {world_size // cp}")
    if device_type is None:
        device_type = cfg.train.device if cfg.train.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = model_shape(cfg.model)
    d = cfg.dist
    ac = cfg.train.ac
    shape.check_supported(ac, d.fsdp_unit if strategy == "fsdp" else "block")
    param_dtype = d.param_dtype if strategy == "fsdp" else "fp32"
    batch = cfg.train.batch_size // (world_size // cp)

    # ---------------------------------------------------------------------- activations
    if isinstance(shape, ViTShape):
        vit = cfg.model.img_hw
        if field or (lr_size and tuple(lr_size) != vit):
            raise ConfigError(f"the ViT's input is its img_size {vit[0]}x{vit[1]} (no crops, no --field): "
                              "set --img_size instead")
        height, width = padded = vit
        p = vit_precision(device_type, cfg.train.amp_dtype, param_dtype)
        kernel = vit_attention_kernel(device_type, p, shape.head_dim)
        graph = vit_training_graph(shape, p, kernel, ac, batch, cfg.train.loss, cfg.train.loss_space)
        tokens = batch * shape.tokens
    elif isinstance(shape, UNet3DShape):
        if field:
            raise ConfigError("the U-Net trains on crop_size³ crops of a volume: --field does not apply; set --crop_size")
        side = lr_size[0] if lr_size else cfg.data.crop_size
        height = width = side
        padded = (side,) * 3
        p = precision_for(device_type, cfg.train.amp_dtype, param_dtype)
        p = dataclasses.replace(p, label=p.label.replace(" (LayerNorm in fp32)", ""))  # no LayerNorm here
        kernel = "conv3d"
        graph = unet3d_training_graph(shape, p.matmul, DTYPE_BYTES[param_dtype], ac, batch, side, cfg.train.lambda_rho)
        tokens = batch * side ** 3
    else:
        p = precision_for(device_type, cfg.train.amp_dtype, param_dtype)
        kernel = attention_kernel(device_type)
        height, width = lr_size or lr_input_size(cfg, field)
        if cp > 1:  # this rank's rows: the first band, the largest (whole windows, no padding)
            start, stop = band_bounds(height, cfg.model.window_size, cp)[0]
            height = stop - start
        pm = shape.pad_multiple
        padded = (math.ceil(height / pm) * pm, math.ceil(width / pm) * pm)
        out_pixels = batch * height * shape.scale * width * shape.scale
        graph = training_graph(shape, p, kernel, ac, batch, padded, out_pixels, cfg.train.loss, cfg.train.loss_space)
        tokens = batch * padded[0] * padded[1]
    parts = held_after_forward(graph)
    if isinstance(shape, SwinIRShape):
        parts.setdefault("rstb_convs", 0.0)
        if cp > 1:  # approximate: each 3x3 convolution saves its input with a halo row above and below
            for part in CONV_PARTS:
                parts[part] = parts.get(part, 0.0) * (height + 2) / height
    # Autocast saves a low-precision copy of each linear/conv weight used outside checkpointed units.
    parts["autocast_weight_copies"] = 2.0 * shape.cast_weights(ac) if p.weight_copies else 0.0
    activations = sum(parts.values())

    # ---------------------------------------------------------------------- temporary peak
    held = activations - parts["autocast_weight_copies"]
    peak_forward, peak_backward = simulate_peak(graph)
    phases = {"forward": max(peak_forward - held, 0.0), "backward": max(peak_backward - held, 0.0)}
    temporary = max(phases.values())

    # ---------------------------------------------------------------------- parameters, optimizer
    num_params = shape.num_params()
    params_detail = {"model_fp32": num_params * 4.0}
    shard = 1
    if strategy == "fsdp":
        if d.hsdp_replicas < 1 or world_size % d.hsdp_replicas:
            raise ConfigError(f"hsdp_replicas {d.hsdp_replicas} must divide world_size {world_size}")
        shard = world_size // d.hsdp_replicas
        params_detail, largest_unit = _fsdp_params(shape, num_params, shard, DTYPE_BYTES[param_dtype],
                                                   d.fsdp_unit, d.reshard_after_forward)
    params = sum(params_detail.values())
    grads = num_params * 4.0 / shard
    if strategy == "ddp" and not d.gradient_as_bucket_view:
        grads *= 2  # DDP's communication buckets are a second copy of the gradients
    if strategy == "fsdp":  # one unit's unsharded gradients, and their copy for the reduce-scatter
        grads += largest_unit * (DTYPE_BYTES[param_dtype] + DTYPE_BYTES[d.reduce_dtype])
    optimizer = num_params * ADAMW_STATE_BYTES / shard + shape.num_param_tensors() * ADAMW_STEP_BYTES

    setting = {
        "model": shape.name, "config": cfg.name, "strategy": strategy, "world_size": world_size,
        "batch_per_rank": batch, "lr_input": list(padded) if isinstance(shape, UNet3DShape) else [height, width],
        "padded_input": list(padded), "tokens_per_rank": tokens,
        "amp_dtype": cfg.train.amp_dtype, "ac": ac, "device_type": device_type, "attention": kernel,
        "precision": p.label, "num_params": num_params,
    }
    if isinstance(shape, ViTShape):
        setting.update(patch_size=shape.patch_size, tokens_per_sample=shape.tokens, loss=cfg.train.loss,
                       loss_space=cfg.train.loss_space)
    elif not lr_size and not cfg.data.crop_size:
        size, source = (field, "set by --field") if field else field_size_of(cfg)
        setting["field"], setting["field_source"] = list(size), source
    if strategy == "fsdp":
        setting.update(shard_group=shard, fsdp_unit=d.fsdp_unit, param_dtype=param_dtype)
    if cp > 1:
        setting["cp"] = cp
    return MemoryEstimate(params, grads, optimizer, activations, temporary, parts, phases, params_detail, setting)


def _fsdp_params(shape, num_params: int, shard: int, param_bytes: int, unit: str,
                 reshard_after_forward: bool) -> tuple[dict[str, float], int]:
    """FSDP2 parameters per rank: fp32 shards, plus the unsharded (all-gathered, param_dtype) copies of
    the root's parameters and of the units in flight; and the parameter count of the largest unit."""
    units = shape.fsdp_units(unit)
    # SwinIR's root: stem, body, upsampler (and RSTB convs for unit "block"); the ViT's: patch and
    # position embeddings, final norm, head.
    root = num_params - sum(units)
    # The current unit and the prefetched next one; without resharding, every unit stays gathered.
    in_flight = 2 * max(units) if reshard_after_forward else sum(units)
    detail = {"sharded_fp32": num_params * 4.0 / shard, "gathered_root": root * float(param_bytes),
              "gathered_units": in_flight * float(param_bytes)}
    return detail, max(units)


# =============================================================================================
# Measurement
# =============================================================================================


class SavedTensorBytes:
    """Bytes autograd saves for backward inside this context, each storage counted once.

    ``exclude``: tensors whose storage is not counted (parameters and buffers: they exist anyway).
    ``hold=False`` keeps nothing (the pack hook drops the tensor): the forward pass then runs in
    little memory but cannot be followed by backward — for measuring forward-saved bytes only.
    Storages are tracked through weak references, so a freed storage whose address is reused
    later is still counted as new, and counting never keeps a tensor alive. ``peak_bytes`` is the
    most that was alive at once (a pipeline frees one microbatch's activations after its backward,
    so its peak depends on the schedule, not only on the total saved).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), hold: bool = True):
        exclude = [getattr(t, "_local_tensor", t) for t in exclude]
        self._excluded = {id(t.untyped_storage()): weakref.ref(t.untyped_storage()) for t in exclude}
        self._seen: dict[int, weakref.ref] = {}
        self.hold = hold
        self.bytes = self.live_bytes = self.peak_bytes = 0
        self.bytes_by_dtype: dict[str, int] = {}
        self.count = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, saved: torch.Tensor):
        # A DTensor (tensor parallelism) holds this rank's shard; an FSDP2 parameter gathered for this
        # block is a parameter (or a view of one), not an activation.
        tensor = getattr(saved, "_local_tensor", saved)
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, nn.Parameter) or isinstance(getattr(saved, "_base", None), nn.Parameter):
            return saved if self.hold else None
        storage = tensor.untyped_storage()
        key = id(storage)
        if not (self._is(self._seen, key, storage) or self._is(self._excluded, key, storage)):
            self._seen[key] = weakref.ref(storage, functools.partial(self._freed, storage.nbytes()))
            self.bytes += storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.bytes_by_dtype[dtype] = self.bytes_by_dtype.get(dtype, 0) + storage.nbytes()
            self.count += 1
        return saved if self.hold else None

    def _freed(self, nbytes: int, _ref) -> None:
        self.live_bytes -= nbytes

    @staticmethod
    def _is(refs: dict, key: int, storage) -> bool:
        ref = refs.get(key)
        return ref is not None and ref() is storage

    @staticmethod
    def _unpack(packed):
        if packed is None:
            raise RuntimeError("SavedTensorBytes(hold=False) dropped the saved tensors: backward is impossible")
        return packed

    def counting(self, enabled: bool = True):
        """This counter as a context manager, or one that counts nothing (e.g. on all but the first step)."""
        return self if enabled else contextlib.nullcontext()

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def _with_statistics(cfg: Config) -> Config:
    """The config with mean/std 0 and 1 where it leaves them to the data's statistics (the ViT's):
    the same tensors are saved whatever the values."""
    m = cfg.model
    if m.mean:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(m, mean=[0.0] * m.in_chans, std=[1.0] * m.in_chans))


def loss_for(cfg: Config):
    """The loss train.py computes (utils.training.build_loss: train.loss in train.loss_space)."""
    from utils.training import build_loss

    return build_loss(_with_statistics(cfg))


def _loss_fn(loss):
    """A loss function, or the name of one (in physical units)."""
    from utils.training import LOSSES

    return loss if callable(loss) else LOSSES[loss]


def _autocast(device: torch.device, amp_dtype: str):
    from utils.precision import autocast

    return autocast(device, amp_dtype)


def forward_and_loss(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str, loss="l1") -> torch.Tensor:
    """The forward half of train.py's step: model under autocast, the loss (a name or :func:`loss_for`) in fp32."""
    with _autocast(lr.device, amp_dtype):
        pred = model(lr)
    return _loss_fn(loss)(pred.float(), hr)


@contextlib.contextmanager
def _fresh_mask_cache():
    """The model caches shift masks per size: masks made under FakeTensorMode must not outlive it."""
    import models.swinir as swinir

    cache = getattr(getattr(swinir, "_cached_shift_mask", None), "cache_clear", None)
    if cache:
        cache()
    try:
        yield
    finally:
        if cache:
            cache()


def trace_saved_activations(model: nn.Module, lr_shape: tuple[int, ...], amp_dtype: str = "none",
                            loss="l1", device: str = "cpu") -> SavedTensorBytes:
    """Saved bytes of forward + loss for an input of ``lr_shape``, without computing anything.

    Parameters, buffers and the input become fake tensors (shape, dtype and device only) and the
    forward runs under FakeTensorMode: every operator dispatches as for real — autocast, the
    model's CPU/CUDA branches, checkpoint hooks — so autograd saves the same tensors, with no data.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    model.train()
    scale = getattr(model, "upscale", 1) if getattr(model, "upsampler", "") else 1
    hr_shape = (*lr_shape[:-2], lr_shape[-2] * scale, lr_shape[-1] * scale)
    if hasattr(model, "out_chans"):  # the U-Net: other channels out than in
        hr_shape = (lr_shape[0], model.out_chans, *lr_shape[2:])
    with _fresh_mask_cache(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {}
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            fake = mode.from_tensor(tensor)
            state[name] = fake.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else fake
        lr = torch.empty(lr_shape, device=device)
        hr = torch.empty(hr_shape, device=device)
        counter = SavedTensorBytes(exclude=state.values())
        with counter:
            with _autocast(lr.device, amp_dtype):
                pred = functional_call(model, state, (lr,))
            _loss_fn(loss)(pred.float(), hr)
    return counter


@dataclass
class MeasuredMemory:
    """Measured memory of one training step (bytes)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Saved for backward at the end of forward + loss (SavedTensorBytes)."""
    peak: float
    """Peak allocated during the step: params + optimizer state + the rise above the step's start."""
    peak_forward: float
    """Peak allocated up to the end of the forward pass and the loss (same reference)."""
    method: str
    activations_by_dtype: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: (round(v / GB, 6) if isinstance(v, (int, float)) else v) for k, v in asdict(self).items()}


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _tensor_bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter=None, marks=None) -> None:
    optimizer.zero_grad(set_to_none=True)
    with counter or contextlib.nullcontext():
        value = forward_and_loss(model, lr, hr, amp_dtype, loss)
    if marks is not None:
        marks.append("forward")
    scaler = torch.amp.GradScaler(lr.device.type, enabled=amp_dtype == "fp16")
    scaler.scale(value).backward()
    scaler.step(optimizer)
    scaler.update()


def _cpu_allocation_peaks(run) -> tuple[float, float]:
    """(peak, peak up to the forward mark) of bytes allocated on the CPU while ``run(mark)`` runs.

    The profiler records every allocation and free with its size; summed in time order they give
    the memory allocated at each moment, relative to the start.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    def mark(_name):
        with record_function("__memory_mark__"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        marks: list = _MarkList(mark)
        run(marks)
    events = prof.profiler.kineto_results.events()
    mark_times = sorted(e.start_ns() for e in events if e.name() == "__memory_mark__")
    forward_end = mark_times[0] if mark_times else float("inf")
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    current = peak = peak_forward = 0
    for when, nbytes in deltas:
        current += nbytes
        peak = max(peak, current)
        if when <= forward_end:
            peak_forward = max(peak_forward, current)
    return float(peak), float(peak_forward)


class _MarkList(list):
    """A list whose append also drops a profiler mark (the end of the forward pass)."""

    def __init__(self, mark):
        super().__init__()
        self._mark = mark

    def append(self, item) -> None:
        self._mark(item)
        super().append(item)


def measure_training_memory(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                            loss="l1", optimizer: Optional[torch.optim.Optimizer] = None) -> MeasuredMemory:
    """Measure one training step of ``model`` (already on lr's device, AC already applied).

    A first step allocates AdamW's state; the second, with gradients set to None as in train.py,
    is measured: saved activations by :class:`SavedTensorBytes`, the peak by CUDA's allocator
    statistics or by the CPU allocation trace. The model's weights change (two AdamW steps).
    """
    device = lr.device
    model.train()
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    _training_step(model, optimizer, lr, hr, amp_dtype, loss)
    params = _tensor_bytes(model.parameters())
    static = params + _optimizer_state_bytes(optimizer)
    counter = SavedTensorBytes(exclude=_model_tensors(model))
    if device.type == "cuda":
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        peaks = []

        class _CudaMarks(list):
            def append(self, item):
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_allocated(device) - start)

        _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter, _CudaMarks())
        torch.cuda.synchronize(device)
        rise, rise_forward = torch.cuda.max_memory_allocated(device) - start, peaks[0]
        method = "torch.cuda.max_memory_allocated"
    else:
        rise, rise_forward = _cpu_allocation_peaks(
            lambda marks: _training_step(model, optimizer, lr, hr, amp_dtype, loss, counter, marks))
        method = "torch.profiler CPU allocation trace"
    grads = _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    return MeasuredMemory(params, grads, _optimizer_state_bytes(optimizer), counter.bytes, static + rise,
                          static + rise_forward, method, dict(counter.bytes_by_dtype))


def measure_saved_activations(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                              loss="l1", hold: bool = False) -> SavedTensorBytes:
    """Saved bytes of one real forward + loss; ``hold=False`` frees them at once (no backward)."""
    model.train()
    counter = SavedTensorBytes(exclude=_model_tensors(model), hold=hold)
    with counter:
        forward_and_loss(model, lr, hr, amp_dtype, loss)
    return counter


def random_batch(cfg: Config, lr_size: Optional[tuple[int, int]] = None, device="cpu", batch: Optional[int] = None):
    """(input, target) of the config's shapes, in physical units around the config's mean and std
    (0 and 1 where the config leaves them to the data). ``lr_size``: default the model's input size."""
    m = cfg.model
    batch = batch or cfg.train.batch_size
    lr_size = lr_size or input_size(cfg)
    scale = m.upscale if m.upsampler and m.model == "swinir" else 1  # the ViT forecasts the same grid
    g = torch.Generator().manual_seed(0)
    if m.model == "unet3d":  # stored fields, already in tanh's range
        side = lr_size[0]
        return tuple((0.3 * torch.randn(batch, c, side, side, side, generator=g)).to(device)
                     for c in (m.in_chans, m.out_chans))
    mean = torch.tensor(m.mean or [0.0] * m.in_chans).view(1, -1, 1, 1)
    std = torch.tensor(m.std or [1.0] * m.in_chans).view(1, -1, 1, 1)
    lr = torch.randn(batch, m.in_chans, *lr_size, generator=g) * std + mean
    hr = torch.randn(batch, m.in_chans, lr_size[0] * scale, lr_size[1] * scale, generator=g) * std + mean
    return lr.to(device), hr.to(device)


def build_for_measurement(cfg: Config, device="cpu") -> nn.Module:
    """The config's model on ``device`` with its activation checkpointing applied, as train.py builds it."""
    from models import build_model
    from utils.parallel.techniques import apply_ac

    torch.manual_seed(cfg.train.seed)
    return apply_ac(build_model(_with_statistics(cfg).model).to(device), cfg.train.ac)


def measure_config(cfg: Config, lr_size: Optional[tuple[int, int]] = None, device="cpu") -> MeasuredMemory:
    """:func:`measure_training_memory` of the config's model, AC, amp_dtype and loss at one input size
    (default: the model's input size, :func:`input_size`)."""
    lr, hr = random_batch(cfg, lr_size, device)
    model = build_for_measurement(cfg, device)
    return measure_training_memory(model, lr, hr, cfg.train.amp_dtype, loss_for(cfg))


def time_training_step(model: nn.Module, lr: torch.Tensor, hr: torch.Tensor, amp_dtype: str = "none",
                       loss="l1", steps: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each timed training step (forward, backward, AdamW), after ``warmup`` steps."""
    device = lr.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    model.train()
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        _training_step(model, optimizer, lr, hr, amp_dtype, loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times

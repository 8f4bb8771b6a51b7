"""The training memory of one rank, predicted from the config: :func:`estimate_memory` (what ``estimate_memory.py``
prints) adds up

* parameters, gradients and AdamW state (two fp32 moments, a step count per tensor) — exact counts from the
  config (:mod:`utils.memory.shapes`), sharded by FSDP2/HSDP (plus its all-gathered units and the root's
  parameters), doubled by DDP's buckets unless ``gradient_as_bucket_view``;
* activations: the bytes autograd holds for backward at the end of the forward pass (and the loss), per layer
  (:mod:`utils.memory.graphs`), for the rank's share of the batch and, with SwinIR's ``cp``, its band of the field;
* temporary: the extra memory of the worst moment of the step on top of the held activations
  (:func:`~utils.memory.graphs.simulate_peak`).

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
  The U-Net's activations are exact to the byte on CPU (fp32, bf16/fp16 autocast, AC none/block,
  ``lambda_rho``; tests/test_memory.py).
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

:mod:`utils.memory.measure` measures the same quantities, without trusting the estimate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from utils.config import Config, ConfigError
from utils.memory.graphs import (attention_kernel, held_after_forward, precision_for, simulate_peak, training_graph,
                                 unet3d_training_graph, vit_attention_kernel, vit_precision, vit_training_graph)
from utils.memory.shapes import SwinIRShape, UNet3DShape, ViTShape, field_size_of, lr_input_size, model_shape
from utils.parallel.domain_parallel import band_bounds
from utils.precision import dtype_bytes

GB = 1e9  # decimal gigabytes, as utils.observe.flops.peak_memory_gb and nvidia-smi's "GB"
ADAMW_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 per parameter
ADAMW_STEP_BYTES = 4  # and one fp32 step count per parameter tensor
CONV_PARTS = ("stem", "rstb_convs", "body", "upsampler")  # SwinIR's parts around its 3x3 convolutions


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
    if cfg.model.model != "swinir" and cfg.dist.cp > 1:
        raise ConfigError(f"the estimate models cp for SwinIR's field bands only, not yet the {cfg.model.model}'s "
                          f"(train_mp.py --cp): estimate without --cp")
    cp = cfg.dist.cp  # SwinIR's cp: bands of each field (domain parallelism)
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
        graph = unet3d_training_graph(shape, p.matmul, dtype_bytes(param_dtype), ac, batch, side, cfg.train.lambda_rho)
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
        params_detail, largest_unit = _fsdp_params(shape, num_params, shard, dtype_bytes(param_dtype),
                                                   d.fsdp_unit, d.reshard_after_forward)
    params = sum(params_detail.values())
    grads = num_params * 4.0 / shard
    if strategy == "ddp" and not d.gradient_as_bucket_view:
        grads *= 2  # DDP's communication buckets are a second copy of the gradients
    if strategy == "fsdp":  # one unit's unsharded gradients, and their copy for the reduce-scatter
        grads += largest_unit * (dtype_bytes(param_dtype) + dtype_bytes(d.reduce_dtype))
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

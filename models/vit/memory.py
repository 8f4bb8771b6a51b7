"""The ViT forecaster's hand-written memory description (models/spec.py's ``memory``): its exact parameter counts
and what each layer of its training step saves for backward (its vocabulary: utils/memory/vocabulary.py).

The training graph: normalisation → patch-embedding convolution → + position embedding, per block LayerNorm →
q, k, v → SDPA → proj → residual → LayerNorm → fc1 → GELU → fc2 → residual, then LayerNorm → head → unpatchify →
de-normalisation, and the loss (L1, MSE or NERSC's relative L2, in physical or normalised units). Its global
attention goes through fused SDPA kernels that save q, k, v, the output and a log-sum-exp per row — not the
tokens × tokens matrix — so it too grows linearly with the tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from utils.memory.vocabulary import (LN_STATS_BYTES, MEASURED_ON_CPU, ActivationGraph, ConfigError, Layer,
                                     MemoryDescription, Traffic, add_params, band_rows, conv_params, dtype_bytes,
                                     loss_layer)


@dataclass(frozen=True)
class ViTShape(MemoryDescription):
    """What the memory of the ViT forecaster depends on (models/vit/network.py), read from the config's model section."""

    in_chans: int
    img_size: tuple[int, int]
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    hidden: int
    qkv_bias: bool
    drop_path_rate: float
    out_chans: int = 0
    """Channels of the output where they are not the input's (task diagnostic); 0: in_chans."""
    sequence_parallel: bool = True
    """train_mp.py's tp splits the residual stream and the LayerNorms by tokens; False: a publication's tp (NERSC's)
    that keeps them whole on every tp rank (plan.py's model of it: :meth:`without_sequence_parallelism`)."""

    @classmethod
    def from_config(cls, m, target_chans: Optional[int] = None) -> "ViTShape":
        a = m.model_args
        return cls(m.in_chans, m.img_hw, a["patch_size"], a["embed_dim"], a["depths"][0], a["num_heads"][0],
                   int(a["embed_dim"] * a["mlp_ratio"]), a["qkv_bias"], a["drop_path_rate"], target_chans or m.in_chans)

    name = "ViT"
    activations_accuracy = {"cpu": MEASURED_ON_CPU, "cuda": "modelled; an H200 within 0.1 %"}

    def input_line(self, s: dict) -> str:
        h, w = s["lr_input"]
        return (f"  input {h}x{w} fields, patch {s['patch_size']} -> {s['tokens_per_sample']:,} tokens per sample, "
                f"batch {s['batch_per_rank']} per rank = {s['tokens_per_rank']:,} tokens; device {s['device_type']} "
                f"({s['attention']} attention); {s['precision']}; activation checkpointing {s['ac']}; "
                f"loss {s['loss']} ({s['loss_space']})")

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
        matmul, total = add_params(qkv, conv_params(d, d, 1), conv_params(d, h, 1), conv_params(h, d, 1))
        return matmul, total + 4 * d  # + norm1, norm2

    def stem_params(self) -> tuple[int, int]:
        """Patch-embedding convolution and the position embedding (added, not cast)."""
        w, total = conv_params(self.in_chans, self.embed_dim, self.patch_size)
        return w, total + self.tokens * self.embed_dim

    def end_params(self) -> tuple[int, int]:
        """Final LayerNorm and the head (no bias)."""
        w = self.embed_dim * (self.out_chans or self.in_chans) * self.patch_size ** 2
        return w, w + 2 * self.embed_dim

    def num_params(self) -> int:
        return self.stem_params()[1] + self.depth * self.block_params()[1] + self.end_params()[1]

    def num_param_tensors(self) -> int:
        """AdamW keeps a step count per tensor: conv 2, pos_embed 1, final norm 2, head 1; per block
        2 LayerNorms x 2, q/k/v weights (and biases), proj, fc1, fc2 x 2."""
        return 6 + self.depth * (10 + 3 * (1 + self.qkv_bias))

    def pipeline_units(self) -> tuple[list[int], int, int]:
        """(parameters of each transformer block, of the stem (patch and position embeddings), of the tail (final
        norm, head)): where a pipeline cuts the ViT (spec.py's plan)."""
        return [self.block_params()[1]] * self.depth, self.stem_params()[1], self.end_params()[1]

    def tp_split_params(self) -> int:
        """Parameters tensor parallelism splits over its ranks (spec.py's plan): every block's but its 2
        LayerNorms and proj's and fc2's biases, and the head's (column-wise)."""
        return self.depth * (self.block_params()[1] - 6 * self.embed_dim) + self.end_params()[0]

    def without_sequence_parallelism(self) -> "ViTShape":
        return dataclasses.replace(self, sequence_parallel=False)

    def unsplit_params(self) -> int:
        """Parameters in tensors whose first dimension is 1, which FSDP2 cannot split: the position embedding."""
        return self.tokens * self.embed_dim

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

    # ------------------------------------------------------------------ activations, communication

    def activation_graph(self, cfg, device_type: str, param_dtype: str, batch: int, graph_batch: int,
                         field: Optional[tuple[int, int]], lr_size: Optional[tuple[int, int]], tp: int,
                         cp: int) -> ActivationGraph:
        """The training graph of the whole img_size field (the position embedding's); under ``cp`` this rank's band
        of tokens (the largest)."""
        vit = cfg.model.img_hw
        if field or (lr_size and tuple(lr_size) != vit):
            raise ConfigError(f"the ViT's input is its img_size {vit[0]}x{vit[1]} (no crops, no --field): "
                              "set --img_size instead")
        p = vit_precision(device_type, cfg.train.amp_dtype, param_dtype)
        kernel = vit_attention_kernel(device_type, p, self.head_dim)
        rows, cols = vit[0] // self.patch_size, vit[1] // self.patch_size
        band = band_rows(rows, cp)[0] * cols if cp > 1 else None  # the largest band's tokens
        graph = vit_training_graph(self, p, kernel, cfg.train.ac, graph_batch, cfg.train.loss, cfg.train.loss_space,
                                   tp, band, self.sequence_parallel)
        setting = {"patch_size": self.patch_size, "tokens_per_sample": self.tokens, "loss": cfg.train.loss,
                   "loss_space": cfg.train.loss_space}
        return ActivationGraph(graph, p.label, p.weight_copies, kernel, vit, vit, batch * (band or self.tokens),
                               setting)

    def model_parallel_traffic(self, tp: int, cp: int, cfg, replica_batch: int, a: int) -> list[Traffic]:
        """tp with sequence parallelism: per block 2 all-gathers and 2 reduce-scatters forward, as many backward; cp:
        the keys and values of all bands gathered forward, their gradients reduce-scattered backward."""
        tokens = replica_batch * self.tokens
        traffic = []
        if tp > 1:
            stream = tokens / cp * self.embed_dim * a  # this cp rank's tokens, gathered over tp
            traffic.append(Traffic("tp all-gather/reduce-scatter", "tp", "all-gather", stream, 8 * self.depth))
        if cp > 1:
            kv = tokens * self.embed_dim / tp * a
            field = replica_batch * self.in_chans * self.img_size[0] * self.img_size[1] * 4
            traffic += [Traffic("cp key/value gather", "cp", "all-gather", kv, 4 * self.depth),
                        Traffic("cp key/value gather", "cp", "all-gather", field, 2)]
        return traffic

    def boundary_bytes(self, cfg, micro: int, a: int) -> float:
        """A pipeline stage sends the next one its tokens."""
        return micro * self.tokens * self.embed_dim * a



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
    param = dtype_bytes(param_dtype)
    autocast_on = amp_dtype != "none"
    low = dtype_bytes(amp_dtype) if autocast_on else param
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


def vit_training_graph(shape: ViTShape, p: ViTPrecision, kernel: str, ac: str, batch: int, loss: str,
                       loss_space: str, tp: int = 1, band_tokens: Optional[int] = None,
                       sequence_parallel: bool = True) -> list[Layer]:
    """The ViT's training step as a list of layers in forward order (models/vit/network.py: ViT.forward).

    Per token and block, fp32: the block input (saved by norm1), LayerNorm statistics, norm1's
    output (shared by q, k and v), q, k, v and the SDPA output (proj's input: a view), the
    log-sum-exp, the mid-block residual (norm2), norm2's output, fc1's output (GELU's input) and
    GELU's output (fc2's input): 16 x D fp32 values + 8 + 4 x heads bytes. Under autocast with fp32
    parameters, q, k and v each cast the LayerNorm output again (three copies, not one: autocast
    caches only leaf weights) and the stream stays fp32.

    Model parallelism (train_mp.py; spec.py's plan): ``tp`` splits the heads and the MLP's
    hidden units, and (sequence parallelism) the residual stream and the LayerNorms by tokens; the inputs of
    q, k, v, fc1 and the head are all-gathered over tp, so each rank saves them whole. Without sequence parallelism
    (``sequence_parallel`` False: NERSC's tp) the stream and the LayerNorms are whole on every rank too. ``band_tokens``
    (context parallelism): the tokens of this rank's latitude band; every block works on them, except that
    the keys and values of all bands are all-gathered (saved whole); the stem runs on the whole field, and the
    head's output is gathered again for the loss.
    """
    d, hid, a, st, ln = shape.embed_dim, shape.hidden, p.matmul, p.stream, p.norm
    tokens = shape.tokens
    mine = band_tokens or tokens
    t_all = batch * tokens  # the whole field's tokens (the stem; keys and values under cp)
    t = batch * mine  # this rank's tokens in the blocks
    ts = t / tp if sequence_parallel else t  # the residual stream and the LayerNorms: split by sequence parallelism
    field = batch * shape.in_chans * shape.img_size[0] * shape.img_size[1]  # values in a batch of fields
    out_field = field // shape.in_chans * (shape.out_chans or shape.in_chans)  # of outputs (other channels: diagnostic)
    casts = 1 if ln == a else 3  # copies of the LayerNorm output that q, k, v save as their input
    skip = ts * d * st  # the residual stream's gradient, waiting while a branch's backward runs
    heads = shape.num_heads / tp
    t_kv = t_all if band_tokens else t  # keys and values: gathered from every band under cp
    if kernel == "math":  # scaled q and k, v, the probabilities; proj's input is a copy of the output
        attention = (2 * t + 2 * t_kv) * d / tp * a + batch * heads * mine * tokens * a
    else:  # q, k, v, the output (proj's input is a view of it) and the fp32 log-sum-exp
        lse = mine if kernel != "efficient" else math.ceil(mine / 32) * 32  # padded to 32 rows
        attention = (2 * t + 2 * t_kv) * d / tp * a + batch * heads * lse * 4

    graph = [  # patch embedding: the convolution saves its (normalised, cast) input; + position embedding
        Layer("patch_embed", field * a, t_all * d * a + field * 4, t_all * d * a + skip),
        Layer("patch_embed", 0.0, skip, 2 * skip),
    ]
    for i in range(shape.depth):
        unit = i if ac == "block" else None
        drop_path = shape.drop_path_rate > 0 and i > 0  # rates linspace(0, r): block 0 has none
        block = [
            # the block input: held by checkpointing, else saved by norm1 (unless it saves an fp32 copy)
            Layer("blocks", ts * d * st if ac == "block" or ln == st else 0.0, unit_input=True),
            Layer("blocks", ts * (p.stats + (d * ln if ln != st else 0)),         # norm1
                  ts * d * ln, ts * d * (2 * ln + st) + skip),
            Layer("blocks", t * casts * d * a, t * 3 * d / tp * a,                  # q, k, v: the gathered input
                  t * (3 * d / tp * a + d * a) + 2 * ts * d * ln + skip),
            Layer("blocks", attention, t * d / tp * a, t * 4 * d / tp * a + skip),  # SDPA
            Layer("blocks", 2 * batch * a if drop_path else 0.0, ts * d * a, 2 * ts * d * a + skip),  # proj, residual
            Layer("blocks", ts * (d * ln + p.stats), ts * d * (st + ln), ts * d * (a + 2 * ln + st) + skip),  # norm2
            Layer("blocks", t * d * a, t * hid / tp * a, t * (hid / tp + d) * a + skip),  # fc1: its gathered input
            Layer("blocks", t * hid / tp * a, t * hid / tp * a, 2 * t * hid / tp * a + skip),  # GELU: its input
            Layer("blocks", t * hid / tp * a, ts * d * a, t * (hid / tp + d) * a + skip),  # fc2: its input
        ]
        for op in block:
            op.unit = unit
            op.unit_input = op.unit_input and ac == "block"
            op.stage_unit = i
        graph += block
    graph += [  # final norm (input, statistics), head (its input, gathered over tp); unpatchify and
        # de-normalisation save nothing
        Layer("head", ts * (d * ln + p.stats), ts * d * ln, ts * d * (a + 2 * ln) + skip),
        Layer("head", t * d * a, 2 * out_field * a + 2 * out_field * 4, 2 * out_field * a + 2 * out_field * 4),
        loss_layer(loss, loss_space, out_field * 4, batch, shape.out_chans or shape.in_chans),
    ]
    return graph



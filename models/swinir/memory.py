"""SwinIR's hand-written memory description (models/spec.py's ``memory``): its exact parameter counts and what each
layer of its training step saves for backward (its vocabulary: utils/memory/vocabulary.py).

The training graph: the convolution and LayerNorm of the stem, per Swin block LayerNorm → window partition → qkv →
window attention → proj → residual → LayerNorm → MLP (GELU) → residual, the RSTB convolution, the body and the
upsampler, and the loss. Windowed attention saves ``heads × window²`` values per pixel, so every term is proportional
to the number of (padded) pixels: activation memory grows linearly with the field, not quadratically as it would
with global attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from utils.memory.vocabulary import (LN_STATS_BYTES, MEASURED_ON_CPU, ActivationGraph, ConfigError, Layer,
                                     MemoryDescription, Precision, Traffic, add_params, band_bounds, conv_params,
                                     field_size_of, loss_layer, lr_input_size, precision_for)

from . import network

NUM_FEAT = 64  # width of SwinIR's reconstruction convolutions (network.py)
CONV_PARTS = ("stem", "rstb_convs", "body", "upsampler")  # the parts around its 3x3 convolutions


@dataclass(frozen=True)
class SwinIRShape(MemoryDescription):
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
    def from_config(cls, m, target_chans: Optional[int] = None) -> "SwinIRShape":
        side, a = min(m.img_hw), m.model_args
        window = a["window_size"] if side > a["window_size"] else side
        return cls(m.in_chans, a["embed_dim"], int(a["embed_dim"] * a["mlp_ratio"]), tuple(a["depths"]),
                   tuple(a["num_heads"]), window, a["window_size"], m.upscale, a["upsampler"], a["resi_connection"],
                   a["qkv_bias"], a["drop_path_rate"])

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
            return conv_params(c, c)
        return add_params(conv_params(c, c // 4), conv_params(c // 4, c // 4, 1), conv_params(c // 4, c))

    def block_params(self, heads: int) -> tuple[int, int]:
        c, h = self.embed_dim, self.hidden
        qkv = (3 * c * c, 3 * c * c + (3 * c if self.qkv_bias else 0))
        table = (2 * self.window - 1) ** 2 * heads
        norms = 4 * c
        matmul, other = add_params(qkv, conv_params(c, c, 1), conv_params(c, h, 1), conv_params(h, c, 1))
        return matmul, other + table + norms

    def rstb_conv_params(self) -> tuple[int, int]:
        return self._resi()

    def stem_params(self) -> tuple[int, int]:
        w, total = conv_params(self.in_chans, self.embed_dim)
        return w, total + 2 * self.embed_dim  # + patch-embedding LayerNorm

    def body_params(self) -> tuple[int, int]:
        w, total = self._resi()
        return w, total + 2 * self.embed_dim  # + final LayerNorm

    def head_params(self) -> tuple[int, int]:
        c, f, out, s = self.embed_dim, NUM_FEAT, self.in_chans, self.upscale
        if self.upsampler == "pixelshuffle":
            stages = [conv_params(f, 4 * f)] * int(math.log2(s)) if s & (s - 1) == 0 else [conv_params(f, 9 * f)]
            return add_params(conv_params(c, f), *stages, conv_params(f, out))
        if self.upsampler == "pixelshuffledirect":
            return conv_params(c, s * s * out)
        if self.upsampler == "nearest+conv":
            ups = [conv_params(f, f)] * (2 if s == 4 else 1)
            return add_params(conv_params(c, f), *ups, conv_params(f, f), conv_params(f, out))
        return conv_params(c, out)

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
    activations_accuracy = {"cpu": MEASURED_ON_CPU, "cuda": "modelled; an H200 within 0.1 %"}

    def input_line(self, s: dict) -> str:
        return (f"  input {s['lr_input'][0]}x{s['lr_input'][1]} low-res{' (the largest band)' if 'cp' in s else ''} "
                f"(padded {s['padded_input'][0]}x{s['padded_input'][1]}), "
                f"batch {s['batch_per_rank']} per rank = {s['tokens_per_rank']:,} tokens; device {s['device_type']} "
                f"({s['attention']} window attention); {s['precision']}; activation checkpointing {s['ac']}")

    def check_supported(self, ac: str = "none", fsdp_unit: str = "block") -> None:
        s = self.upscale
        if self.upsampler == "pixelshuffle" and not (s & (s - 1) == 0 or s == 3):
            raise ConfigError(f"upscale {s} is not supported by upsampler 'pixelshuffle': use 2^n or 3")
        if self.upsampler == "nearest+conv" and s not in (2, 4):
            raise ConfigError(f"upscale {s} is not supported by upsampler 'nearest+conv': use 2 or 4")

    def unsplit_params(self) -> int:
        """Parameters in tensors whose first dimension is 1, which FSDP2 cannot split: none."""
        return 0

    def fsdp_units(self, unit: str) -> list[int]:
        """Parameters of each FSDP unit: every Swin block, or every RSTB (its blocks and convolution)."""
        if unit == "block":
            return [self.block_params(h)[1] for d, h in zip(self.depths, self.num_heads) for _ in range(d)]
        return [sum(self.block_params(h)[1] for _ in range(d)) + self.rstb_conv_params()[1]
                for d, h in zip(self.depths, self.num_heads)]

    def pipeline_units(self) -> tuple[list[int], int, int]:
        """(parameters of each unit a pipeline cuts at: every RSTB, those the first stage keeps before them (the
        stem), those the last keeps after them (final norm, body convolution, upsampler)): spec.py's plan."""
        return self.fsdp_units("layer"), self.stem_params()[1], self.body_params()[1] + self.head_params()[1]

    def tp_split_params(self) -> int:
        """Parameters tensor parallelism splits over its ranks (spec.py's plan): every Swin block's but
        its 2 LayerNorms and proj's and fc2's biases."""
        return sum(b - 6 * self.embed_dim for b in self.fsdp_units("block"))

    def cast_weights(self, ac: str) -> int:
        """Linear/conv weights whose autocast copies stay saved: those used outside checkpointed units."""
        block_w = sum(d_ * self.block_params(h)[0] for d_, h in zip(self.depths, self.num_heads))
        rstb_w = len(self.depths) * self.rstb_conv_params()[0]
        outside_ac = self.stem_params()[0] + self.body_params()[0] + self.head_params()[0]
        return outside_ac + {"none": block_w + rstb_w, "block": rstb_w, "layer": 0}[ac]

    # ------------------------------------------------------------------ activations, communication

    def activation_graph(self, cfg, device_type: str, param_dtype: str, batch: int, graph_batch: int,
                         field: Optional[tuple[int, int]], lr_size: Optional[tuple[int, int]], tp: int,
                         cp: int) -> ActivationGraph:
        """The training graph of the low-res crop or whole field (``lr_size`` if given); under ``cp`` (domain
        parallelism) this rank's band of rows, the first, the largest (whole windows, no padding)."""
        p = precision_for(device_type, cfg.train.amp_dtype, param_dtype)
        kernel = attention_kernel(device_type)
        height, width = lr_size or lr_input_size(cfg, field)
        if cp > 1:
            start, stop = band_bounds(height, self.pad_multiple, cp)[0]  # whole windows
            height = stop - start
        pm = self.pad_multiple
        padded = (math.ceil(height / pm) * pm, math.ceil(width / pm) * pm)
        out_pixels = graph_batch * height * self.scale * width * self.scale
        graph = training_graph(self, p, kernel, cfg.train.ac, graph_batch, padded, out_pixels, cfg.train.loss,
                               cfg.train.loss_space, tp)
        setting = {}
        if not lr_size and not cfg.data.crop_size:
            size, source = (field, "set by --field") if field else field_size_of(cfg)
            setting = {"field": list(size), "field_source": source}
        return ActivationGraph(graph, p.label, p.weight_copies, kernel, (height, width), padded,
                               batch * padded[0] * padded[1], setting)

    def adjust_held(self, parts: dict[str, float], graph: ActivationGraph, cp: int) -> None:
        parts.setdefault("rstb_convs", 0.0)
        if cp > 1:  # approximate: each 3x3 convolution saves its input with a halo row above and below
            height = graph.input_size[0]
            for part in CONV_PARTS:
                parts[part] = parts.get(part, 0.0) * (height + 2) / height

    def model_parallel_traffic(self, tp: int, cp: int, cfg, replica_batch: int, a: int) -> list[Traffic]:
        """tp without sequence parallelism: per Swin block 2 all-reduces forward, 2 backward; cp: halo rows, 1 per
        3x3 convolution, half a window per shifted block, both ways, forward and backward."""
        height, width = lr_input_size(cfg)
        traffic = []
        if tp > 1:
            stream = replica_batch * height * width / cp * self.embed_dim * a
            traffic.append(Traffic("tp all-reduce", "tp", "all-reduce", stream, 4 * self.num_blocks))
        if cp > 1:
            row = replica_batch * width * self.embed_dim * a
            convs = len(self.depths) + 2
            shifted = sum(d // 2 for d in self.depths)
            traffic.append(Traffic("cp halo exchange", "cp", "exchange",
                                   4 * (convs + shifted * self.window / 2) * row, 4 * (convs + shifted)))
        return traffic

    def boundary_bytes(self, cfg, micro: int, a: int) -> float:
        """A pipeline stage sends the next one its features and the long skip (fp32)."""
        height, width = lr_input_size(cfg)
        return 2 * micro * height * width * self.embed_dim * 4



def attention_kernel(device_type: str) -> str:
    """Which attention the model runs in training: see WindowAttention.forward."""
    return "explicit" if device_type == "cpu" else "sdpa"


def _swin_block(shape: SwinIRShape, heads: int, p: Precision, kernel: str, shifted: bool, tokens: int,
                batch: int, drop_path: bool, tp: int = 1) -> list[Layer]:
    """The saved tensors of one Swin block (models/swinir/network.py: SwinTransformerBlock._forward).

    ``tp`` (spec.py's plan, no sequence parallelism): each rank holds heads / tp of the
    attention and hid / tp of the MLP, so what is saved after qkv and fc1 shrinks by tp; the LayerNorms, the
    residual stream and the inputs of qkv and fc1 stay whole on every rank."""
    c, hid, n, a, st = shape.embed_dim, shape.hidden / tp, shape.window ** 2, p.matmul, p.stream
    heads = heads / tp
    cs = c / tp  # this rank's channels of q, k, v and the attention output
    att = heads * n * a  # one attention matrix: heads x window^2 values per token
    skips = c * a + 2 * c * st  # gradients waiting at the long, RSTB and block skip connections
    t = tokens

    def layer(saved, fwd=0.0, bwd=0.0):
        return Layer("swin_blocks", t * saved, t * fwd, t * (bwd + skips))

    layers = [Layer("swin_blocks", t * c * st, unit_input=True),           # block input, saved by norm1
              layer(LN_STATS_BYTES, c * a, c * a + c * st)]                 # norm1 (statistics)
    head_dim = c // (heads * tp)  # SDPA's heads on CUDA: padded to the kernels' multiple by the model
    padded = heads * (head_dim + _sdpa_head_pad(head_dim))
    if kernel == "explicit":
        layers += [
            layer(c * a, 3 * cs * a, 3 * cs * a + 2 * c * a),      # qkv: its input, the norm1 output in windows
            layer(2 * cs * a, 3 * cs * a + att, att + 2 * cs * a),  # q k^T: scaled q, contiguous copy of k^T
            layer(att, 3 * cs * a + 2 * att, 2 * att + cs * a),    # softmax: the probabilities
            layer(cs * a, cs * a, att + 2 * cs * a),               # probs @ v: contiguous copy of v
            layer(cs * a, c * a, cs * a + c * a),                  # proj: its input
        ]
    else:
        # CUDA: the memory-efficient kernel (the model hands SDPA a contiguous bias, which it takes; with a permuted
        # view an H200 ran the math fallback instead). It keeps q, k, v, its output (all padded copies: the model
        # pads the heads), the fp32 log-sum-exp and the bias as SDPA got it: per window only in a shifted block
        # (bias + shift mask; at batch > 1 expanded to every image), one (heads, N, N) for all windows otherwise.
        # Its backward writes the bias gradient per (image, window) before it is summed back: one attention
        # matrix. proj's input is a copy of the output's unpadded part.
        bias = att if shifted else 0.0
        qkv_out = 3 * padded * a + padded * a + (cs * a if padded != cs else 0.0)
        layers += [
            layer(c * a, 3 * cs * a, 3 * cs * a + 2 * c * a),                     # qkv: its input
            layer(qkv_out + 4 * heads + bias, padded * a + bias, 4 * padded * a + att),  # attention, proj's input
        ]
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
    """Channels the model adds to each CUDA attention head for the fused kernel (models/swinir/network.py)."""
    multiple = network.SDPA_HEAD_DIM_MULTIPLE.get("cuda", 1)
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
                   out_pixels: int, loss: str, loss_space: str = "physical", tp: int = 1) -> list[Layer]:
    """SwinIR's training step as a list of layers in forward order (models/swinir/network.py: SwinIR.forward); ``tp``:
    tensor parallelism's share of each Swin block (:func:`_swin_block`)."""
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
                                drop_path=shape.drop_path_rate > 0 and block_index > 0, tp=tp)  # rates linspace(0, r)
            block_index += 1
            for op in block:
                op.unit = {"none": None, "block": unit, "layer": layer_index}[ac]
                op.unit_input = op.unit_input and (ac == "block" or (ac == "layer" and i == 0))
                op.stage_unit = layer_index
            unit += 1
            graph += block
        conv = Layer("rstb_convs", tokens * _resi_conv(shape, a), tokens * c * a,
                     tokens * (2 * c * a + c * st + c * a), unit=layer_index if ac == "layer" else None,
                     stage_unit=layer_index)
        graph.append(conv)
    graph += [Layer("body", tokens * (c * st + LN_STATS_BYTES), tokens * c * a, tokens * 3 * c * a),  # norm
              Layer("body", tokens * _resi_conv(shape, a), tokens * c * a, tokens * 3 * c * a)]   # conv_after_body
    graph += _upsampler(shape, a, tokens)
    # The cropped fp32 prediction and the loss's intermediate exist in forward; their gradients in backward.
    graph.append(loss_layer(loss, loss_space, out_pixels * shape.in_chans * 4, batch, shape.in_chans))
    return graph



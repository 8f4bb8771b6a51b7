"""Each model's training step as a list of layers in forward order: what autograd saves for backward.

A :class:`Layer` holds the bytes one operation saves for backward, what is alive only while its forward or
its backward runs, and the activation-checkpointing unit it belongs to (``ac: none``, ``block`` or ``layer``).
:class:`Precision` / :class:`ViTPrecision` type the saved tensors for a device and the mixed-precision settings.

* SwinIR (``models/swinir.py``, :func:`training_graph`): the convolution and LayerNorm of the stem, per Swin
  block LayerNorm → window partition → qkv → window attention → proj → residual → LayerNorm → MLP (GELU) →
  residual, the RSTB convolution, the body and the upsampler, and the loss. Windowed attention saves
  ``heads × window²`` values per pixel, so every term is proportional to the number of (padded) pixels:
  activation memory grows linearly with the field, not quadratically as it would with global attention.
* The ViT (``models/vit.py``, :func:`vit_training_graph`): normalisation → patch-embedding convolution →
  + position embedding, per block LayerNorm → q, k, v → SDPA → proj → residual → LayerNorm → fc1 → GELU →
  fc2 → residual, then LayerNorm → head → unpatchify → de-normalisation, and the loss (L1, MSE or NERSC's
  relative L2, in physical or normalised units). Its global attention goes through fused SDPA kernels that
  save q, k, v, the output and a log-sum-exp per row — not the tokens × tokens matrix — so it too grows
  linearly with the tokens.
* SC22's U-Net (``models/unet3d.py``, :func:`unet3d_training_graph`): each convolution saves its input, each
  in-place activation its output (the same tensor as the next convolution's input), the up path also the
  concatenations [upsampled, skip]; tanh its output, L1 the difference.

:func:`held_after_forward` is what the graph holds at the end of the forward pass (the estimate's
activations); :func:`simulate_peak` walks the same list as autograd walks it: forward adds what each layer
saves; backward, in reverse, frees it once the layer's backward has run, re-creates a checkpointed unit's
tensors when backward reaches it, and adds each layer's transient tensors (gradients in flight, attention
logits and their gradients, the upsampler's high-res gradients) — the estimate's temporary peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import models.swinir as swinir
from utils.memory.shapes import NUM_FEAT, SwinIRShape, UNet3DShape, ViTShape
from utils.precision import dtype_bytes

LN_STATS_BYTES = 8  # LayerNorm keeps mean and 1/std per token, in fp32 even for bf16 inputs


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
    stage_unit: Optional[int] = None
    """The unit a pipeline cuts at (the ViT's block, SwinIR's RSTB) it belongs to; None: the stem or the tail."""


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


# ------------------------------------------------------------------ SwinIR (models/swinir.py)


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


def attention_kernel(device_type: str) -> str:
    """Which attention the model runs in training: see WindowAttention.forward."""
    return "explicit" if device_type == "cpu" else "sdpa"


def _swin_block(shape: SwinIRShape, heads: int, p: Precision, kernel: str, shifted: bool, tokens: int,
                batch: int, drop_path: bool, tp: int = 1) -> list[Layer]:
    """The saved tensors of one Swin block (models/swinir.py: SwinTransformerBlock._forward).

    ``tp`` (utils/parallel/plans.py's SwinIR row, no sequence parallelism): each rank holds heads / tp of the
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
    """Channels the model adds to each CUDA attention head for the fused kernel (models/swinir.py)."""
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
                   out_pixels: int, loss: str, loss_space: str = "physical", tp: int = 1) -> list[Layer]:
    """SwinIR's training step as a list of layers in forward order (models/swinir.py: SwinIR.forward); ``tp``:
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
                       loss_space: str, tp: int = 1, band_tokens: Optional[int] = None) -> list[Layer]:
    """The ViT's training step as a list of layers in forward order (models/vit.py: ViT.forward).

    Per token and block, fp32: the block input (saved by norm1), LayerNorm statistics, norm1's
    output (shared by q, k and v), q, k, v and the SDPA output (proj's input: a view), the
    log-sum-exp, the mid-block residual (norm2), norm2's output, fc1's output (GELU's input) and
    GELU's output (fc2's input): 16 x D fp32 values + 8 + 4 x heads bytes. Under autocast with fp32
    parameters, q, k and v each cast the LayerNorm output again (three copies, not one: autocast
    caches only leaf weights) and the stream stays fp32.

    Model parallelism (train_mp.py; utils/parallel/plans.py's ViT row): ``tp`` splits the heads and the MLP's
    hidden units, and (sequence parallelism) the residual stream and the LayerNorms by tokens; the inputs of
    q, k, v, fc1 and the head are all-gathered over tp, so each rank saves them whole. ``band_tokens``
    (context parallelism): the tokens of this rank's latitude band; every block works on them, except that
    the keys and values of all bands are all-gathered (saved whole); the stem runs on the whole field, and the
    head's output is gathered again for the loss.
    """
    d, hid, a, st, ln = shape.embed_dim, shape.hidden, p.matmul, p.stream, p.norm
    tokens = shape.tokens
    mine = band_tokens or tokens
    t_all = batch * tokens  # the whole field's tokens (the stem; keys and values under cp)
    t = batch * mine  # this rank's tokens in the blocks
    ts = t / tp  # sequence-parallel share: the residual stream and the LayerNorms
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

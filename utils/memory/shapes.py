"""What the memory of each model depends on, read from the config: its shape and its input size.

:class:`SwinIRShape` (``models/swinir.py``), :class:`ViTShape` (``models/vit.py``) and :class:`UNet3DShape`
(``models/unet3d.py``) give the exact parameter counts (and the parameter tensors AdamW keeps a step count
for), the parameters of each FSDP unit, the linear/conv weights whose autocast copies stay saved, and which
``ac``/``fsdp_unit`` settings the model supports; :func:`model_shape` picks the config's. :func:`input_size`
is the size of the model's input: SwinIR's low-res crop or whole field, the ViT's img_size, the U-Net's cube.
What each layer saves for backward is :mod:`utils.memory.graphs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from utils.config import Config, ConfigError
from utils.data.common import DataError
from utils.data.files import scan_split

ERA5_FIELD = (720, 1440)  # SuperBench's 721 x 1440 with the last latitude row dropped
NUM_FEAT = 64  # width of SwinIR's reconstruction convolutions (models/swinir.py)


# =============================================================================================
# The model's shape, from the config
# =============================================================================================


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
    def from_config(cls, m, target_chans: Optional[int] = None) -> "SwinIRShape":
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
        stem), those the last keeps after them (final norm, body convolution, upsampler)): utils/parallel/plans.py."""
        return self.fsdp_units("layer"), self.stem_params()[1], self.body_params()[1] + self.head_params()[1]

    def tp_split_params(self) -> int:
        """Parameters tensor parallelism splits over its ranks (utils/parallel/plans.py): every Swin block's but
        its 2 LayerNorms and proj's and fc2's biases."""
        return sum(b - 6 * self.embed_dim for b in self.fsdp_units("block"))

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
    out_chans: int = 0
    """Channels of the output where they are not the input's (task diagnostic); 0: in_chans."""

    @classmethod
    def from_config(cls, m, target_chans: Optional[int] = None) -> "ViTShape":
        return cls(m.in_chans, m.img_hw, m.patch_size, m.embed_dim, m.depths[0], m.num_heads[0],
                   int(m.embed_dim * m.mlp_ratio), m.qkv_bias, m.drop_path_rate, target_chans or m.in_chans)

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
        norm, head)): where a pipeline cuts the ViT (utils/parallel/plans.py)."""
        return [self.block_params()[1]] * self.depth, self.stem_params()[1], self.end_params()[1]

    def tp_split_params(self) -> int:
        """Parameters tensor parallelism splits over its ranks (utils/parallel/plans.py): every block's but its 2
        LayerNorms and proj's and fc2's biases, and the head's (column-wise)."""
        return self.depth * (self.block_params()[1] - 6 * self.embed_dim) + self.end_params()[0]

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


@dataclass(frozen=True)
class UNet3DShape:
    """What the memory of SC22's 3-D U-Net depends on (models/unet3d.py), read from the config's model section."""

    in_chans: int
    out_chans: int
    widths: tuple[int, ...]
    """Channels of every level of the down path, the full_scale level included."""

    @classmethod
    def from_config(cls, m, target_chans: Optional[int] = None) -> "UNet3DShape":
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

    def unsplit_params(self) -> int:
        """Parameters in tensors whose first dimension is 1, which FSDP2 cannot split: none."""
        return 0

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


SHAPES = {"swinir": SwinIRShape, "vit": ViTShape, "unet3d": UNet3DShape}


def has_description(model_cfg) -> bool:
    """Whether the config's model has a hand-written description here (else the estimate traces it:
    utils/memory/traced.py)."""
    return getattr(model_cfg, "model", None) in SHAPES


def model_shape(model_cfg, target_chans: Optional[int] = None) -> "SwinIRShape | ViTShape | UNet3DShape":
    """The shape the estimate needs of the config's model (``model: swinir``, ``vit`` or ``unet3d``); ``target_chans``
    (``Config.target_chans``): the channels of its output."""
    if not has_description(model_cfg):
        raise ConfigError(f"model {getattr(model_cfg, 'model', None)!r} has no hand-written memory description "
                          "(utils/memory/shapes.py): use the traced estimate (utils/memory/traced.py)")
    return SHAPES[model_cfg.model].from_config(model_cfg, target_chans)


# =============================================================================================
# Input geometry
# =============================================================================================


def field_size_of(cfg: Config) -> tuple[tuple[int, int], str]:
    """High-res whole-field size when crop_size is 0, and where it came from: the data's grid if
    the training split exists, else ERA5's 720 x 1440."""
    split = Path(cfg.data.data_dir) / cfg.data.train_split
    try:
        first = scan_split(split)[0]
    except DataError:
        return ERA5_FIELD, f"ERA5's grid ({split} has no data; --field HxW sets another)"
    return (first.height - 1, first.width), f"the grid of {first.path}"  # the dataset drops the last row


def lr_input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """Height and width of the model's input: the low-res crop, or the low-res whole field."""
    hr = (cfg.data.crop_size, cfg.data.crop_size) if cfg.data.crop_size else (field or field_size_of(cfg)[0])
    if cfg.data.task in ("forecast", "diagnostic"):
        return hr
    s = cfg.model.upscale
    if hr[0] % s or hr[1] % s:
        raise ConfigError(f"the high-res size {hr[0]}x{hr[1]} is not divisible by upscale {s}")
    return hr[0] // s, hr[1] // s


def input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, ...]:
    """Spatial size of the model's input, by task (any model's, as the contract says): a forecaster's img_size (the
    field it is given; the ViT's only size), a super-resolver's low-res input, a volume's crop (side, side, side)."""
    if cfg.data.task in ("forecast", "diagnostic"):
        return cfg.model.img_hw
    if cfg.data.task == "volume":
        return (cfg.data.crop_size,) * 3
    return lr_input_size(cfg, field)

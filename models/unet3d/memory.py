"""SC22's U-Net's hand-written memory description (models/spec.py's ``memory``): its exact parameter counts and what
each layer of its training step saves for backward (its vocabulary: utils/memory/vocabulary.py).

The training graph: each convolution saves its input, each in-place activation its output (the same tensor as the
next convolution's input), the up path also the concatenations [upsampled, skip]; tanh its output, L1 the
difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from utils.memory.vocabulary import (MEASURED_ON_CPU, ActivationGraph, ConfigError, Layer, MemoryDescription,
                                     dtype_bytes, loss_layer, precision_for)


@dataclass(frozen=True)
class UNet3DShape(MemoryDescription):
    """What the memory of SC22's 3-D U-Net depends on (models/unet3d/network.py), read from the config's model section."""

    in_chans: int
    out_chans: int
    widths: tuple[int, ...]
    """Channels of every level of the down path, the full_scale level included."""

    @classmethod
    def from_config(cls, m, target_chans: Optional[int] = None) -> "UNet3DShape":
        widths = m.model_args["widths"]
        return cls(m.in_chans, m.out_chans, tuple(widths) + ((widths[-1],) if m.model_args["full_scale"] else ()))

    name = "U-Net"
    activations_accuracy = {"cpu": MEASURED_ON_CPU, "cuda": "modelled"}  # no attention: no H200 figure to cite

    def input_line(self, s: dict) -> str:
        return (f"  input {s['lr_input'][0]}³ crops, batch {s['batch_per_rank']} per rank = {s['tokens_per_rank']:,} "
                f"voxels; device {s['device_type']}; {s['precision']}; activation checkpointing {s['ac']}")

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

    def activation_graph(self, cfg, device_type: str, param_dtype: str, batch: int, graph_batch: int,
                         field: Optional[tuple[int, int]], lr_size: Optional[tuple[int, int]], tp: int,
                         cp: int) -> ActivationGraph:
        """The training graph of crop_size³ crops (``lr_size``'s side if given)."""
        if field:
            raise ConfigError("the U-Net trains on crop_size³ crops of a volume: --field does not apply; set --crop_size")
        side = lr_size[0] if lr_size else cfg.data.crop_size
        p = precision_for(device_type, cfg.train.amp_dtype, param_dtype)
        label = p.label.replace(" (LayerNorm in fp32)", "")  # no LayerNorm here
        graph = unet3d_training_graph(self, p.matmul, dtype_bytes(param_dtype), cfg.train.ac, graph_batch, side,
                                      cfg.train.lambda_rho)
        return ActivationGraph(graph, label, p.weight_copies, "conv3d", (side,) * 3, (side,) * 3, batch * side ** 3)



def unet3d_training_graph(shape: UNet3DShape, a: int, input_held: int, ac: str, batch: int, side: int,
                          lambda_rho: float = 0.0) -> list[Layer]:
    """The U-Net's training step as a list of layers in forward order (models/unet3d/network.py: UNet3D.forward).

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



"""keep_fp32: named parts of a model run in fp32 under bf16 autocast, the rest in bf16 (utils/precision.py).

The dtypes are read where they are made: a forward hook on every module records the dtype of its output, under
CPU autocast (bf16 is autocast's CPU dtype; the kept parts' rule is the same on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import build_model
from models.spec import ModelSpec, register
from tests.conftest import read_metrics, run_script, vit_args
from utils.config import ConfigError, build_config
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, autocast, fp32_module_names

CPU = torch.device("cpu")


def output_dtypes(model: nn.Module, x: torch.Tensor) -> dict[str, torch.dtype]:
    """{module name: dtype of its output} of one forward under bf16 autocast (hooks added after keep_fp32's, so
    they see what the modules after them get)."""
    seen = {}

    def record(name):
        def hook(_module, _args, out):
            if isinstance(out, torch.Tensor):
                seen.setdefault(name, out.dtype)  # the first call's (a module called again gets the same)
        return hook

    for name, module in model.named_modules():
        module.register_forward_hook(record(name))
    with autocast(CPU, "bf16"):
        model(x)
    return seen


def tiny_vit() -> nn.Module:
    cfg = build_config("vit_quickstart", {"img_size": [16, 32], "in_chans": 2, "channel_names": ["u", "v"],
                                          "mean": [0.0, 0.0], "std": [1.0, 1.0],
                                          "model_args": {"patch_size": 4, "embed_dim": 16, "depths": [2],
                                                         "num_heads": [2]}})
    torch.manual_seed(0)
    return build_model(cfg.model)


def test_the_vit_keeps_its_spec_s_norms_and_head_in_fp32_and_the_rest_in_bf16():
    x = torch.randn(2, 2, 16, 32)
    plain = output_dtypes(tiny_vit(), x)
    kept = output_dtypes(apply_keep_fp32(tiny_vit(), True), x)
    norms = ["norm", "transformer.0.norm1", "transformer.0.norm2", "transformer.1.norm1"]
    assert all(kept[name] == torch.float32 for name in [*norms, "head"])
    assert plain["head"] == torch.bfloat16  # without the key autocast runs the head's matmul in bf16
    # the attention's and MLP's linears and the patch embedding stay autocast's (bf16)
    for name in ["patch_embed", "transformer.0.attn.q", "transformer.0.attn.proj", "transformer.1.mlp.fc1"]:
        assert kept[name] == plain[name] == torch.bfloat16, name


def test_the_kept_parts_compute_in_fp32_not_only_return_it():
    """The head under keep_fp32 gives the fp32 head's result on the same input (bf16 would be ~1e-2 off)."""
    model = apply_keep_fp32(tiny_vit(), True)
    x = torch.randn(3, 16, 16, dtype=torch.bfloat16)  # what the head gets from the bf16 parts before it
    with autocast(CPU, "bf16"):
        out = model.head(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ model.head.weight.T, rtol=1e-6, atol=1e-6)


class SpectralMix(nn.Module):
    """A spectral layer: a learned filter of the Fourier modes, then a channel mix."""

    def __init__(self, hidden: int, size: int):
        super().__init__()
        self.filter = nn.Parameter(torch.ones(size, size // 2 + 1))
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, h):
        filtered = torch.fft.irfft2(torch.fft.rfft2(h.float()) * self.filter, s=h.shape[-2:])  # FFTs take no bf16
        return self.mix(filtered.movedim(1, -1)).movedim(-1, 1)


class OwnModel(nn.Module):
    """A model of one's own, with a normalisation and a spectral layer."""

    def __init__(self, chans: int = 2, hidden: int = 8, size: int = 8):
        super().__init__()
        self.lift = nn.Conv2d(chans, hidden, 1)
        self.norm = nn.GroupNorm(2, hidden)
        self.spectral = SpectralMix(hidden, size)
        self.out = nn.Conv2d(hidden, chans, 1)

    def forward(self, x):
        h = self.norm(self.lift(x))
        return self.out(self.spectral(h) + h)


class DeclaredOwnModel(OwnModel):
    pass


register(ModelSpec(DeclaredOwnModel, fp32_modules=("norm", "spectral")))


def test_a_model_of_one_s_own_keeps_what_the_config_lists_or_its_spec_declares():
    x = torch.randn(2, 2, 8, 8)
    listed = output_dtypes(apply_keep_fp32(OwnModel(), True, ["norm", "spec*"]), x)
    declared = output_dtypes(apply_keep_fp32(DeclaredOwnModel(), True), x)
    for dtypes in (listed, declared):
        assert dtypes["norm"] == dtypes["spectral"] == dtypes["spectral.mix"] == torch.float32  # its children too
        assert dtypes["lift"] == dtypes["out"] == torch.bfloat16
    assert output_dtypes(OwnModel(), x)["spectral"] == torch.bfloat16


def test_names_are_the_outermost_matches_and_mistakes_are_one_line():
    vit = tiny_vit()
    assert fp32_module_names(vit, ["transformer.0*"]) == ["transformer.0"]  # its children run inside its region
    with pytest.raises(ConfigError, match="'nrom' matches no module of ViT"):
        fp32_module_names(vit, ["*norm*", "nrom"])
    with pytest.raises(ConfigError, match="OwnModel's spec declares no fp32_modules"):
        apply_keep_fp32(OwnModel(), True)
    with pytest.raises(ConfigError, match="add --amp_dtype bf16"):
        build_config("vit_quickstart", {"keep_fp32": True})
    with pytest.raises(ConfigError, match="add --keep_fp32 true"):
        build_config("vit_quickstart", {"fp32_modules": ["head"], "amp_dtype": "bf16"})
    refused = run_script("estimate_memory.py", "--config", "vit_quickstart", "--amp_dtype", "bf16", "--keep_fp32",
                         "true", in_process=True, check=False)
    assert refused.returncode == 2 and "does not model --keep_fp32 true" in refused.stderr


def test_off_it_wraps_nothing():
    vit = tiny_vit()
    apply_keep_fp32(vit, False)
    assert not any("forward" in vars(m) for m in vit.modules())


def test_compiled_and_checkpointed_blocks_keep_it():
    """Applied before activation checkpointing and torch.compile, as the scripts do: the same forward and dtypes."""
    x = torch.randn(2, 2, 16, 32)
    eager = apply_keep_fp32(tiny_vit(), True)
    compiled = apply_compile(apply_ac(apply_keep_fp32(tiny_vit(), True), "block"), True, "aot_eager")
    with autocast(CPU, "bf16"):
        expected, got = eager(x), compiled(x)
    got.float().square().mean().backward()
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert all(p.grad is not None for p in compiled.parameters())


def test_train_py_trains_with_bf16_and_the_kept_parts_without_compile(vit_data, tmp_path):
    run = tmp_path / "kept"
    run_script("train.py", *vit_args(vit_data, run, "--max_steps", "3", "--log_every", "1", "--amp_dtype", "bf16",
                                     "--keep_fp32", "true", "--compile", "false"), in_process=True)
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))

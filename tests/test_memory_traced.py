"""utils/memory/traced.py: the training memory of any model, traced on fake tensors, against real steps.

A model the project never saw (examples/fno's Fourier neural operator, Part IV's model of your own, built from its
config as train.py builds it) within the issue's 10 % of its measured peak; estimate_memory.py and plan.py falling
back to the trace for a model without a hand-written description; what cannot be traced, or is not traced, refused
in one line. (The built-in models against the steps tests/test_memory.py measures and the record of
tests/test_fsdp.py's run; the whole grid of layouts on 2-4 processes: benchmarks/validate_traced_estimate.py.)
"""

import dataclasses

import pytest
from torch import nn

import estimate_memory
from models import spec as specs
from models.unet3d import UNet3D
from tests.conftest import REPO
from utils.config import ConfigError, build_config
from utils.memory import traced
from utils.memory.measure import build_for_measurement, measure_layout
from utils.memory.traced import CannotTrace, estimate_model, estimate_traced
from utils.parallel.plans import ModelPlan
from utils.plan.clusters import load_cluster
from utils.plan.planner import plan
from utils.training import run_cli

SHAPE = (2, 3, 16, 32)
FNO_CONFIGS = REPO / "examples" / "fno" / "fno.yaml"  # fno.py (model_class fno:FNO2d) lies beside it


def fno_config(**keys):
    return build_config("fno_quickstart", {**keys, "device": "cpu"}, FNO_CONFIGS)


def test_a_model_the_project_never_saw_within_10_percent_of_its_measured_peak():  # units: its plan's blocks()
    # The quickstart's batch (8 x 20 x 32 x 64), bf16, AC block, measured as train.py builds and steps it: on a
    # 2-core Xeon VM 32.31 MB traced, 32.32 MB measured (benchmarks/README.md: every layout on 1-4 processes).
    cfg = fno_config(amp_dtype="bf16", ac="block")
    measured = measure_layout(cfg)
    predicted = estimate_traced(cfg, device_type="cpu")
    assert abs(predicted.total / measured.peak - 1) <= 0.10, (predicted.total, measured.peak)
    assert predicted.setting["peak_phase"] and predicted.setting["model"] == "FNO2d"
    # What stays after the step is exact: fp32 parameters (the complex spectral weights stored as their real views,
    # models.store_complex_as_real) and gradients, AdamW's two moments and step counts.
    model = build_for_measurement(cfg)
    assert model.layers[0].spectral.weights.is_complex() and not any(p.is_complex() for p in model.parameters())
    params, tensors = sum(p.numel() for p in model.parameters()) * 4, len(list(model.parameters()))
    assert predicted.setting["num_params"] * 4 == params
    assert predicted.setting["states_gb"] * 1e9 == pytest.approx(4 * params + 4 * tensors, abs=1e3)
    # DDP's buckets hold the gradients from the wrap on (gradient_as_bucket_view: they are the gradients); FSDP over
    # 2 ranks holds half of the states. Over 4 still half: FSDP2 shards dim 0, which for the spectral weights (nearly
    # all of them) is their two corners, (2, width, width, modes, modes): a corner per rank, padding on ranks 2 and 3.
    assert estimate_traced(cfg, 2, "ddp", "cpu").grads == params
    fsdp = estimate_traced(cfg, 2, "fsdp", "cpu")
    assert fsdp.setting["states_gb"] == pytest.approx(predicted.setting["states_gb"] / 2, rel=0.1)
    assert fsdp.params_detail["sharded_param"] == pytest.approx(params / 2, rel=0.1)
    assert estimate_traced(cfg, 4, "fsdp", "cpu").params_detail["sharded_param"] == pytest.approx(params / 2, rel=0.1)


UNET = ["--config", "unet3d_quickstart", "--crop_size", "16", "--model_args.widths", "[4, 8]", "--batch_size", "2"]


def test_a_model_without_a_description_is_traced_by_estimate_memory_and_plan(monkeypatch, tmp_path, capsys):
    # As for a model plugged in from outside: no memory description, and no units (two layouts on one process: fp32,
    # bf16).
    monkeypatch.setitem(specs._SPECS, UNet3D, dataclasses.replace(specs.class_spec(UNet3D), memory=None,
                                                                  plan=ModelPlan()))
    assert estimate_memory.main(UNET) == 0
    table = capsys.readouterr().out
    for words in ("UNet3D training memory, traced — config unet3d_quickstart", "input 2x4x16x16x16 per rank",
                  "at the peak (", "after the step"):
        assert words in table, words
    file = tmp_path / "one.yaml"
    file.write_text("one-cpu: {device: cpu, gpu: a CPU, gpus_per_node: 1, memory_gb: 1, peak_bf16_tflops: 0.1, "
                    "peak_tf32_tflops: 0.05, nvlink_gbps: 1, network_gbps: 1, latency_us: 50, "
                    "efficiency: {unet3d: {bf16: 0.2, fp32: 0.3}}}\n")
    cfg = build_config("unet3d_quickstart", {"crop_size": 16, "model_args.widths": [4, 8], "batch_size": 2})
    rows = plan(cfg, load_cluster("one-cpu", file), 1)
    assert {r.layout.precision for r in rows} == {"fp32", "bf16"}
    assert all(r.estimate.setting["method"] == "traced" and 0 < r.gb < 0.01 for r in rows)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x) if x.mean().item() > 0 else x  # a value fake tensors do not have


def test_what_cannot_be_traced_is_one_line(monkeypatch, capsys):
    with pytest.raises(CannotTrace, match="cannot trace DataDependent's training step on fake tensors: "
                                          "DataDependentOutputException"):
        estimate_model(DataDependent(), SHAPE, SHAPE, "mse")
    monkeypatch.setattr(traced, "model_on_meta", lambda cfg: DataDependent())
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: estimate_memory.main([*UNET, "--traced"]))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cannot trace DataDependent" in err and len(err.strip().splitlines()) == 1


def test_model_parallelism_without_a_description_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="tp 2: the traced estimate covers one device, DDP, FSDP and HSDP; "
                                          "FNO2d has no hand-written memory description"):
        estimate_traced(fno_config(tp=2))
    with pytest.raises(ConfigError, match="world_size 2 needs strategy ddp or fsdp"):
        estimate_traced(build_config("vit_quickstart"), 2, "none")

"""A model of your own, first class: by class path from a folder outside the repository, its config starting from a
named one (``base:``), its contract checked when it is built (one line per breach), its plan beside it.

The models here are written into the test's own folder, as a user's would be; examples/fno (Part IV) is the
worked example, run by the pages' tests.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import estimate_memory
from models import ModelError, build_model
from models import spec as specs
from models.spec import ModelPlan, built_in, register_plan
from tests.conftest import FakeMesh, exit_in_one_process, read_metrics, run_script
from utils.config import ConfigError, build_config
from utils.parallel.plans import ac_units, model_plan
from utils.parallel.tensor_parallel import apply_tp
from utils.tasks import Diagnostic, Forecast, task_class

MODELS = '''
import torch
from torch import nn
from models.common import PhysicalUnitsModel


class Mixer(PhysicalUnitsModel):
    """A forecaster in the contract: takes the data's in_chans, mean and std, normalises inside."""

    def __init__(self, in_chans, mean, std, hidden=8, depth=2):
        super().__init__()
        self.register_normalization(mean, std)
        self.inp = nn.Conv2d(in_chans, hidden, 1)
        self.body = nn.ModuleList(nn.Conv2d(hidden, hidden, 3, padding=1) for _ in range(depth))
        self.out = nn.Conv2d(hidden, in_chans, 1)

    def blocks(self):
        return list(self.body)

    def forward(self, x):
        h = self.inp((x - self.data_mean) / self.data_std)
        for block in self.body:
            h = h + torch.tanh(block(h))
        return x + self.out(h) * self.data_std


class Spectral(Mixer):
    def __init__(self, in_chans, mean, std, hidden=8, depth=2):
        super().__init__(in_chans, mean, std, hidden, depth)
        self.weights = nn.Parameter(torch.randn(4, 4, dtype=torch.cfloat))

    def forward(self, x):
        return super().forward(x) * (1 + 0.01 * self.weights.abs().mean())


class Raw(nn.Module):
    """No mean and std: it would train on raw z500 (~5e4)."""

    def __init__(self, in_chans):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, in_chans, 1)

    def forward(self, x):
        return self.conv(x)


class Shrinks(Mixer):
    def forward(self, x):
        return super().forward(x)[..., ::2]


def picky(in_chans, mean, std, hidden):
    if hidden % 2:
        raise ValueError(f"hidden must be even, got {hidden}")
    return Mixer(in_chans, mean, std, hidden)


class Pointwise(PhysicalUnitsModel):
    """A diagnostic model in the contract: in_chans channels in, out_chans others out, each side's statistics."""

    def __init__(self, in_chans, out_chans, mean, std, out_mean, out_std, hidden=8):
        super().__init__()
        self.register_normalization(mean, std, out_mean, out_std)
        self.net = nn.Sequential(nn.Conv2d(in_chans, hidden, 1), nn.GELU(), nn.Conv2d(hidden, out_chans, 1))

    def forward(self, x):
        return self.net((x - self.data_mean) / self.data_std) * self.target_std + self.target_mean
'''

CONFIGS = '''
mixer:
  base: vit_quickstart
  model: mixer
  model_class: mymodels:Mixer
  model_args: {hidden: 8}
  max_steps: 4
  val_every: 4
  log_every: 2
mixer_deeper:
  base: mixer
  model_args: {depth: 3}
bare: {base: vit_quickstart, model: mine, model_class: "mymodels:Mixer"}
t2m_from_wind:  # a task declared by its channels on a forecast base (20 channels): in_chans, out_chans, ... follow
  base: vit_quickstart
  task: diagnostic
  input_channels: [u10, v10]
  target_channels: [t2m]
  model: pointwise
  model_class: mymodels:Pointwise
  max_steps: 3
  val_every: 3
loop_a: {base: loop_b}
loop_b: {base: loop_a}
orphan: {base: nowhere}
'''


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """A folder outside the repository with a user's models, task and configs, as a scientist would have."""
    folder = tmp_path_factory.mktemp("my_project")
    (folder / "mymodels.py").write_text(textwrap.dedent(MODELS))
    (folder / "mytasks.py").write_text(textwrap.dedent(TASKS))
    (folder / "configs.yaml").write_text(textwrap.dedent(CONFIGS))
    return folder


TASKS = """
from utils.observe.scores import RMSEAccumulator
from utils.tasks import Forecast


class ForecastAndIncrement(Forecast):
    # One score more: the RMSE of the model's increment (pred - input) against the true one.
    def new_accumulators(self, channels, device):
        return {**super().new_accumulators(channels, device),
                "increment_rmse": RMSEAccumulator(channels, device, self.row_weights)}

    def update(self, accumulators, inputs, pred, target):
        super().update(accumulators, inputs, pred, target)
        accumulators["increment_rmse"].update(pred - inputs, target - inputs)


class NotATask:
    pass
"""


def config(folder: Path, name: str = "mixer", **overrides):  # overrides: keys of the config, as on the command line
    stats = {"mean": [0.0] * 20, "std": [1.0] * 20}  # what the data would fill in
    return build_config(name, {**stats, **overrides}, folder / "configs.yaml")


def test_a_config_of_yours_starts_from_a_named_one_across_files(user_folder):
    cfg = config(user_folder, "mixer_deeper", **{"model_args.hidden": 6})
    assert (cfg.data.task, cfg.train.batch_size, cfg.train.max_steps) == ("forecast", 8, 4)  # from vit_quickstart
    assert cfg.model.model_args == {"hidden": 6, "depth": 3}  # merged name by name: base, own, command line
    assert cfg.model.model_path == str(user_folder)
    model = build_model(cfg)
    assert type(model).__name__ == "Mixer" and len(model.blocks()) == 3
    with pytest.raises(ConfigError, match="configs loop_a -> loop_b -> loop_a name each other as base"):
        config(user_folder, "loop_a")
    with pytest.raises(ConfigError, match="unknown base 'nowhere' of config 'orphan'"):
        config(user_folder, "orphan")


@pytest.mark.parametrize("overrides, message", [
    ({"model_class": "nowhere:Net"}, "model_class nowhere:Net: no module 'nowhere' on PYTHONPATH or in "),
    ({"model_class": "mymodels:Nothing"}, "model_class mymodels:Nothing: module mymodels (.*) has no class or function"),
    ({"model_args.width": 3}, r"model_args width: not an argument of mymodels:Mixer \(it takes hidden, depth\)"),
    ({"model_class": "mymodels:picky"}, "mymodels:picky needs hidden: set them in model_args"),
    ({"model_class": "mymodels:picky", "model_args.hidden": 3}, r"mymodels:picky\(.*hidden=3\): hidden must be even"),
])
def test_a_model_that_cannot_be_built_is_one_line(user_folder, overrides, message):
    with pytest.raises((ModelError, ConfigError), match=message) as info:  # when the config is read, or built
        build_model(config(user_folder, "bare", **overrides))
    assert "\n" not in str(info.value)


def test_complex_parameters_are_stored_real_and_trained_as_complex_ones(user_folder):
    """A complex parameter (neuraloperator's spectral weights) is stored as its real view: fused AdamW takes it,
    and one step moves the complex weight exactly as AdamW moves the same complex parameter left as it was."""
    torch.manual_seed(0)
    model = build_model(config(user_folder, "bare", model_class="mymodels:Spectral"))
    torch.manual_seed(0)
    plain = build_model(config(user_folder, "bare"))  # the same Mixer: compare the shared layers too
    assert all(not p.is_complex() for p in model.parameters()) and model.weights.is_complex()
    stored = dict(model.named_parameters())["parametrizations.weights.original0"]
    assert stored.shape == (4, 4, 2) and stored.data_ptr() == model.weights.data_ptr()  # a view, no copy
    reference = torch.nn.Parameter(model.weights.detach().clone())
    x = torch.randn(2, 4, dtype=torch.cfloat)
    for loss, params, fused in (((x @ model.weights).abs().sum(), model.parameters(), True),
                                ((x @ reference).abs().sum(), [reference], False)):
        loss.backward()
        torch.optim.AdamW(params, lr=0.1, fused=fused).step()
    torch.testing.assert_close(model.weights, reference, rtol=0, atol=1e-7)
    assert len(list(plain.parameters())) == len(list(model.parameters())) - 1


@pytest.mark.parametrize("model_class, message", [
    ("mymodels:Raw", "mymodels:Raw takes no mean and std, but task forecast gives it physical units"),
    ("mymodels:Shrinks", r"mymodels:Shrinks maps a sample of task forecast of shape \(20, 16, 32\) to \(20, 16, 16\), "
                         r"but the targets are \(20, 16, 32\)"),
])
def test_the_contract_is_checked_for_the_task_at_build_time(user_folder, model_class, message):
    cfg = config(user_folder, "bare", model_class=model_class)
    sample = (torch.zeros(20, 16, 32), torch.zeros(20, 16, 32))
    with pytest.raises(ModelError, match=message):
        Forecast.check_model(Forecast.__new__(Forecast), cfg.model, sample)


def test_a_diagnostic_task_asks_a_model_for_the_targets_statistics(user_folder):
    cfg = config(user_folder, "bare")  # Mixer takes mean and std, not out_mean and out_std
    sample = (torch.zeros(20, 16, 32), torch.zeros(1, 16, 32))
    with pytest.raises(ModelError, match="mymodels:Mixer takes no out_mean and out_std, but task diagnostic asks it "
                                         "for other channels than it reads"):
        Diagnostic.check_model(Diagnostic.__new__(Diagnostic), cfg.model, sample)


def test_a_task_class_must_subclass_the_built_in_task(user_folder):
    cfg = config(user_folder, task_class="mytasks:NotATask")
    with pytest.raises(ConfigError, match="task_class mytasks:NotATask is not a subclass of utils.tasks.Forecast"):
        task_class(cfg, Forecast)
    with pytest.raises(ModelError, match="task_class nowhere:Task: no module 'nowhere'"):
        task_class(config(user_folder, task_class="nowhere:Task"), Forecast)


def test_its_plan_units_from_blocks_and_a_missing_technique_named(user_folder):
    model = build_model(config(user_folder))
    assert ac_units(model, "block") == list(model.body)  # no plan registered: the contract's blocks()
    assert model_plan(model).tp is None
    with pytest.raises(ConfigError, match=r"the Mixer has no tensor-parallel plan: use --tp 1, or declare one beside "
                                          r"the model \(register_plan\(Mixer"):
        apply_tp(model, FakeMesh())


def test_the_built_in_names_and_keys_stay_the_built_in_models(user_folder):
    with pytest.raises(ConfigError, match="model 'vit' is the built-in one, but model_class is mymodels:Mixer: give "
                                          "your model a name of its own"):
        config(user_folder, model="vit")
    with pytest.raises(ConfigError, match="model 'mixer' is not one of the built-in models"):
        build_config("vit_quickstart", {"model": "mixer"})
    # A subclass of a built-in model with a plan of its own is yours: the name still means the built-in model.
    vit = built_in("vit")
    try:
        register_plan(type("MyViT", (vit.model_class,), {}), ModelPlan())
        assert built_in("vit") is vit and build_config("vit_quickstart").model.model_class == vit.build
    finally:
        specs._SPECS.pop(next(c for c in specs._SPECS if c.__name__ == "MyViT"), None)


def test_it_trains_and_resumes_like_a_built_in_model(user_folder, vit_data, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--config_file", str(user_folder / "configs.yaml"), "--config", "mixer", "--data_dir", str(vit_data),
            "--run_dir", str(run), "--batch_size", "4", "--val_samples", "5", "--progress", "never"]
    run_script("train.py", *args, "--task_class", "mytasks:ForecastAndIncrement", in_process=True)
    val = [r for r in read_metrics(run) if r["kind"] == "val"]
    assert [r["step"] for r in val] == [4]
    # A task of yours: its own score beside the built-in ones (pred - input against target - input: the RMSE again).
    assert val[0]["increment_rmse"] == pytest.approx(val[0]["rmse"], rel=1e-5)
    run_script("train.py", *args, "--max_steps", "6", "--resume", in_process=True)  # the checkpoint finds the model
    code, err = exit_in_one_process(capsys, "train.py", *args, "--model_args.hidden", "4", "--resume", "--max_steps", "8")
    assert code == 2 and "holds a model built with other settings: model_args" in err[-1], err


def test_a_task_declared_by_its_channels_trains_a_model_of_yours_on_a_forecast_base(user_folder, vit_data, tmp_path,
                                                                                     capsys):
    args = ["--config_file", str(user_folder / "configs.yaml"), "--config", "t2m_from_wind", "--data_dir",
            str(vit_data), "--run_dir", str(tmp_path / "run"), "--batch_size", "4", "--val_samples", "5",
            "--progress", "never"]
    said = run_script("train.py", *args, in_process=True).stdout
    assert "rmse: t2m " in said and "linear_rmse: t2m " in said  # the target's name, not the base's 20 channels
    val = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "val"][-1]
    assert val["step"] == 3 and len(val["rmse"]) == len(val["linear_rmse"]) == 1
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step_00000003.pt", weights_only=False)["config"]
    assert (saved["in_chans"], saved["out_chans"], saved["channel_names"], saved["key_channels"]) == \
        (2, 1, ["t2m"], ["t2m"])
    mean = np.load(vit_data / "stats" / "global_means.npy").reshape(-1)  # the data's: u10 0, v10 1, t2m 2
    assert saved["mean"] == pytest.approx(mean[[0, 1]].tolist()) and saved["out_mean"] == pytest.approx([mean[2]])
    # An out_chans of yours that contradicts the targets: one line that names both keys, exit 2.
    code, err = exit_in_one_process(capsys, "train.py", *args, "--out_chans", "3")
    assert code == 2 and err == ["train.py: error: out_chans 3 disagrees with target_channels [t2m] (1 channel): task "
                                 "diagnostic takes out_chans from target_channels; drop out_chans"], err


def test_a_complex_weight_model_resumes_exactly_and_loads_into_its_own_class(user_folder, vit_data, tmp_path):
    """4 steps straight and 2 + 2 resumed end with the same bits; the checkpoint, its complex weights given back
    under their own names, loads into the model's class built without this project."""
    from models import complex_state_dict
    common = ["--config_file", str(user_folder / "configs.yaml"), "--config", "mixer", "--model_class",
              "mymodels:Spectral", "--data_dir", str(vit_data), "--batch_size", "4", "--val_samples", "0",
              "--progress", "never"]
    run_script("train.py", *common, "--run_dir", str(tmp_path / "straight"), "--max_steps", "4", in_process=True)
    run_script("train.py", *common, "--run_dir", str(tmp_path / "resumed"), "--max_steps", "2", in_process=True)
    run_script("train.py", *common, "--run_dir", str(tmp_path / "resumed"), "--max_steps", "4", "--resume",
               in_process=True)
    straight, resumed = (torch.load(tmp_path / run / "checkpoints" / "step_00000004.pt", weights_only=False)["model"]
                         for run in ("straight", "resumed"))
    assert "parametrizations.weights.original0" in straight
    assert all(torch.equal(straight[k], resumed[k]) for k in straight) and straight.keys() == resumed.keys()
    sys.path.insert(0, str(user_folder))
    try:
        import mymodels
        own = mymodels.Spectral(20, [0.0] * 20, [1.0] * 20)
    finally:
        sys.path.remove(str(user_folder))
    plain = complex_state_dict(straight)
    own.load_state_dict(plain)
    assert own.weights.is_complex() and torch.equal(torch.view_as_real(own.weights.detach()),
                                                    straight["parametrizations.weights.original0"])


DESCRIBED = '''
from torch import nn
from models.spec import ModelSpec, register
from utils.memory.graphs import Layer
from utils.memory.shapes import ActivationGraph, MemoryDescription


class Described(nn.Module):
    """One 1x1 convolution, with a hand-written memory description: no windows, nothing padded."""

    def __init__(self, in_chans):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, in_chans, 1)

    def forward(self, x):
        return self.conv(x)


class DescribedShape(MemoryDescription):
    name = "Described"

    def __init__(self, chans):
        self.chans = chans

    @classmethod
    def from_config(cls, m, target_chans=None):
        return cls(m.in_chans)

    def num_params(self):
        return self.chans * self.chans + self.chans

    def num_param_tensors(self):
        return 2

    def fsdp_units(self, unit):
        return []

    def cast_weights(self, ac):
        return self.chans * self.chans

    def activation_graph(self, cfg, device_type, param_dtype, batch, graph_batch, field, lr_size, tp, cp):
        h, w = cfg.model.img_hw
        values = graph_batch * self.chans * h * w * 4.0
        return ActivationGraph([Layer("body", values, 0.0, values)], "fp32", False, "conv2d", (h, w), (h, w),
                               batch * h * w)


register(ModelSpec(Described, memory=DescribedShape))
'''


def test_the_estimate_of_a_model_of_yours_speaks_of_it_in_its_own_words(user_folder, capsys):
    # The table's input line and the activations' accuracy come from the model's description: it printed SwinIR's
    # "window attention, padded" line for any model not named ViT or U-Net.
    (user_folder / "described.py").write_text(DESCRIBED)
    (user_folder / "described.yaml").write_text("described: {base: vit_quickstart, model: described, "
                                                "model_class: 'described:Described'}\n")
    try:
        assert estimate_memory.main(["--config_file", str(user_folder / "described.yaml"),
                                     "--config", "described"]) == 0
    finally:
        specs._SPECS.pop(next((c for c in specs._SPECS if c.__name__ == "Described"), None), None)
        sys.modules.pop("described", None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Described training memory estimate — config described:"), lines
    assert re.fullmatch(r"  input \d+x\d+, batch \d+ per rank; device cpu; .*; activation checkpointing none",
                        lines[1]), lines
    assert not any(word in line for line in lines for word in ("window", "padded", "SwinIR", "on CPU", "H200")), lines
    assert "as described (not measured here)" in next(line for line in lines if line.lstrip().startswith("activations"))

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
from torch import nn

import estimate_memory
from models import ModelError, build_model, complex_state_dict, config_spec, copy_model
from models import spec as specs
from models.spec import ModelPlan, built_in, register_plan, top_level_parts
from tests.conftest import FakeMesh, assert_layout_equal, check_layouts, exit_in_one_process, read_metrics, run_script
from utils.config import ConfigError, build_config
from utils.parallel.plans import ac_units, model_plan
from utils.parallel.tensor_parallel import apply_tp
from utils.tasks import Diagnostic, Forecast, Volume, task_class

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


class Half(nn.Module):
    """A mean but no std: it cannot normalise, nor can the project standardise around it."""

    def __init__(self, in_chans, mean):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, in_chans, 1)

    def forward(self, x):
        return self.conv(x)


class Factorized(nn.Module):
    """A complex weight in a class that takes no subclass without a name, as tensorly-torch's FactorizedTensor, which
    holds neuraloperator's spectral weights: torch's parametrize, which subclasses the owner's class, fails on it."""

    def __init_subclass__(cls, name, **kwargs):
        super().__init_subclass__(**kwargs)

    def __init__(self, *shape):
        super().__init__()
        self.tensor = nn.Parameter(0.1 * torch.randn(*shape, dtype=torch.cfloat))


class SpectralConv(nn.Module):
    """Reads its Factorized weight, which is never called itself (neuraloperator's SpectralConv)."""

    def __init__(self, width, modes):
        super().__init__()
        self.weight = Factorized(width, width, modes, modes)

    def forward(self, h):
        m = self.weight.tensor.shape[-1]
        spectrum = torch.fft.rfft2(h)
        mixed = torch.zeros_like(spectrum)
        mixed[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[..., :m, :m], self.weight.tensor)
        return torch.fft.irfft2(mixed, s=h.shape[-2:])


class Library(nn.Module):
    """A library's model, by class path only: its own argument names (in_channels, out_channels: model_args), no
    mean and std (the project standardises around it), no blocks() (its top-level parts are its units)."""

    def __init__(self, in_channels, out_channels, width=8, modes=4):
        super().__init__()
        self.lift = nn.Conv2d(in_channels, width, 1)
        self.spectral = SpectralConv(width, modes)
        self.project = nn.Conv2d(width, out_channels, 1)

    def forward(self, x):
        h = self.lift(x)
        return self.project(torch.tanh(h + self.spectral(h)))


class Cube(nn.Module):
    """A 3-D model without a spec: task volume's crops, (B, 4, D, D, D) -> (B, 5, D, D, D)."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3, padding=1)

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
library:
  base: mixer
  model: library
  model_class: mymodels:Library
  model_args: {in_channels: 20, out_channels: 20}
cube:
  base: unet3d_quickstart
  model: cube
  model_class: mymodels:Cube
  model_args: {in_channels: 4, out_channels: 5}
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
    ("mymodels:Half", r"mymodels:Half takes mean but not std: task forecast gives it physical units \(z500"),
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
    with pytest.raises(ModelError, match="mymodels:Mixer takes mean, std but not out_mean, out_std: task diagnostic "
                                         r"gives it physical units \(z500 ~5e4, t2m ~280\) and wants other channels back in "
                                         "their own units"):
        Diagnostic.check_model(Diagnostic.__new__(Diagnostic), cfg.model, sample)


def test_a_library_model_as_it_is_units_around_it_complex_weights_in_a_class_that_takes_no_subclass(user_folder):
    """Library: no mean and std, no blocks(), a complex weight in a class that refuses subclasses (the build failed in
    torch's parametrize with a TypeError, as neuraloperator's FNO did)."""
    torch.manual_seed(0)
    mean, std = [float(c) for c in range(20)], [1.0 + c for c in range(20)]
    model = build_model(config(user_folder, "library", mean=mean, std=std))
    owner = model.spectral.weight
    assert type(owner) is mymodels_class(user_folder, "Factorized")  # its class as it was, not a subclass
    assert not any(p.is_complex() for p in model.parameters()) and owner.tensor.is_complex()
    stored = model.state_dict()["spectral.weight.parametrizations.tensor.original0"]
    assert stored.shape == (8, 8, 4, 4, 2) and stored.data_ptr() == owner.tensor.data_ptr()
    assert ac_units(model, "block") == [model.lift, model.spectral, model.project]  # its top-level parts
    # Physical units in and out: standardised with the data's statistics around the model's own forward.
    x = torch.randn(2, 20, 16, 32) * 10 + 100
    column = (1, 20, 1, 1)
    expected = type(model).forward(model, (x - torch.tensor(mean).view(column)) / torch.tensor(std).view(column))
    out = model(x)
    torch.testing.assert_close(out, expected * torch.tensor(std).view(column) + torch.tensor(mean).view(column))
    # The complex weight read in forward is differentiated through its stored real view; fused AdamW takes it.
    out.pow(2).mean().backward()
    real = model.spectral.weight.parametrizations.tensor.original0
    assert real.grad is not None and real.grad.abs().max() > 0
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
    # A copy views its own parameter (copy.deepcopy refuses the view: models.copy_model).
    copied = copy_model(model)
    assert copied.spectral.weight.tensor.data_ptr() == copied.spectral.weight.parametrizations.tensor.original0.data_ptr()
    assert copied.spectral.weight.tensor.data_ptr() != owner.tensor.data_ptr()
    torch.testing.assert_close(copied(x), model(x))


def test_the_units_of_a_model_without_a_plan_are_its_parts_none_holding_most_of_it():
    """top_level_parts: the parts a model's forward calls, a container's (never called itself) in its place, and a
    part with more than half of the parameters split into its own (as FSDP2 wants units: no gather of nearly all)."""
    net = nn.Module()
    net.stem = nn.Linear(8, 8)
    net.big = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64))  # 4,736 of the 4,880 parameters
    net.layers = nn.ModuleList([nn.Linear(8, 8)])
    assert top_level_parts(net) == [net.stem, net.big[0], net.big[1], net.layers[0]]
    wrapped = nn.Sequential(nn.Sequential(net))  # down a chain of single parts
    assert top_level_parts(wrapped) == top_level_parts(net)
    with pytest.raises(ConfigError, match="the Linear has no unit"):  # nothing to checkpoint: one line
        ac_units(nn.Linear(2, 2), "block")


def mymodels_class(folder: Path, name: str):
    sys.path.insert(0, str(folder))
    try:
        import mymodels
        return getattr(mymodels, name)
    finally:
        sys.path.remove(str(folder))


def test_a_model_without_a_spec_trains_on_every_task_whose_contract_it_meets(user_folder):
    cube = config(user_folder, "cube", mean=[], std=[])  # task volume: no spec says otherwise (MONAI's UNet was refused)
    assert config_spec(cube.model).tasks == ("sr", "forecast", "diagnostic", "volume")
    volume = (torch.zeros(4, 16, 16, 16), torch.zeros(5, 16, 16, 16))
    Volume.check_model(Volume.__new__(Volume), cube.model, volume)
    flat = config(user_folder, "cube", mean=[], std=[], model_class="mymodels:Library",  # 2-D: what cannot work
                  **{"model_args.in_channels": 4, "model_args.out_channels": 5})
    with pytest.raises(ModelError, match=r"mymodels:Library cannot take a sample of task volume, shape \(batch, 4, 16, "
                                         r"16, 16\): ") as info:
        Volume.check_model(Volume.__new__(Volume), flat.model, volume)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="task volume trains on the stored .* leave mean, std, out_mean and out_std "
                                          "empty"):
        config(user_folder, "cube", mean=[0.0] * 4, std=[1.0] * 4)


def test_what_cannot_work_is_one_line_also_under_launch_py(user_folder, volume_data, tmp_path):
    """A model refused after the ranks have started (its contract, checked on a sample of the data) is the line of rank
    0 alone: launch.py, the project's torchrun, leaves out torchrun's elastic traceback and its log lines."""
    proc = run_script("launch.py", "--standalone", "--nproc-per-node", "2", "train_ddp.py", "--config_file",
                      str(user_folder / "configs.yaml"), "--config", "cube", "--model_class", "mymodels:Library",
                      "--model_args.in_channels", "4", "--model_args.out_channels", "5", "--data_dir",
                      str(volume_data), "--run_dir", str(tmp_path / "run"), check=False)
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(said) == 1, said
    assert said[0].startswith("error: mymodels:Library cannot take a sample of task volume, shape (batch, 4, 32, 32, "
                              "32): "), said


def test_a_library_model_s_layouts_equal_one_process(user_folder, vit_data):
    """DDP, FSDP2 and HSDP with activation checkpointing of its top-level parts, its complex weight gathered by FSDP2
    and viewed afresh in each forward and recomputation: check_layouts.py's harness, as for the built-in models."""
    code, rows = check_layouts("--config_file", str(user_folder / "configs.yaml"), "--config", "library", "--data_dir",
                               str(vit_data), "--ac", "block", "--batch", "4", ranks=2)
    ran = [row for row in rows if "passed" in row]
    assert code == 0 and [row["layout"] for row in ran] == ["dp2 DDP", "dp2 FSDP", "dp2 HSDP(2 replicas)"], rows
    for row in ran:
        assert_layout_equal(row)


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


@pytest.mark.parametrize("name, model_class, stored", [
    ("mixer", "Spectral", "parametrizations.weights.original0"),
    ("library", "Library", "spectral.weight.parametrizations.tensor.original0"),  # its class takes no subclass
])
def test_a_complex_weight_model_resumes_exactly_and_loads_into_its_own_class(user_folder, vit_data, tmp_path, name,
                                                                             model_class, stored):
    """4 steps straight and 2 + 2 resumed end with the same bits; the checkpoint, its complex weights given back
    under their own names, loads into the model's class built without this project."""
    common = ["--config_file", str(user_folder / "configs.yaml"), "--config", name, "--model_class",
              f"mymodels:{model_class}", "--data_dir", str(vit_data), "--batch_size", "4", "--val_samples", "0",
              "--progress", "never"]
    run_script("train.py", *common, "--run_dir", str(tmp_path / "straight"), "--max_steps", "4", in_process=True)
    run_script("train.py", *common, "--run_dir", str(tmp_path / "resumed"), "--max_steps", "2", in_process=True)
    run_script("train.py", *common, "--run_dir", str(tmp_path / "resumed"), "--max_steps", "4", "--resume",
               in_process=True)
    straight, resumed = (torch.load(tmp_path / run / "checkpoints" / "step_00000004.pt", weights_only=False)["model"]
                         for run in ("straight", "resumed"))
    assert stored in straight
    assert all(torch.equal(straight[k], resumed[k]) for k in straight) and straight.keys() == resumed.keys()
    cls = mymodels_class(user_folder, model_class)
    own = cls(20, [0.0] * 20, [1.0] * 20) if model_class == "Spectral" else cls(20, 20)
    own.load_state_dict(complex_state_dict(straight))
    weight = own.get_parameter(stored.replace(".original0", "").replace("parametrizations.", ""))
    assert weight.is_complex() and torch.equal(torch.view_as_real(weight.detach()), straight[stored])


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

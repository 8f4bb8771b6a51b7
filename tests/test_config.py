"""Named configs, overrides, types and errors."""

import re
import subprocess
import sys
from unittest import mock

import pytest

import estimate_memory
import utils.config_files as config_files
from utils.checkpoint.files import CheckpointError
from models.spec import built_in, old_flat_keys
from utils.checkpoint.reading import Checkpoint
from utils.checkpoint.state import check_model_settings
from utils.config import (APPLIED_BY, CHECKED_SCRIPTS, KEYS, SECTIONS, ConfigError, build_config, field_docs,
                          load_named_configs, parse_config)
from tests.conftest import REPO, exit_in_one_process
from utils.predict.model import config_from_checkpoint

NAMED = ["baseline", "quickstart", "full_size", "synthetic_large"]


@pytest.mark.parametrize("name", NAMED)
def test_named_configs_build(name):
    cfg = build_config(name)
    assert cfg.name == name
    assert cfg.train.batch_size > 0


def test_baseline_is_the_tutorial():
    cfg = build_config("baseline")
    assert (cfg.data.crop_size, cfg.model.upscale, cfg.train.batch_size) == (128, 2, 16)
    assert (cfg.train.lr, cfg.train.weight_decay, cfg.train.lr_gamma) == (8e-4, 1e-6, 0.97)
    assert (cfg.train.loss, cfg.train.epochs, cfg.data.num_workers) == ("l1", 2, 4)
    assert cfg.model.model_args["depths"] == [6] * 6 and cfg.model.model_args["embed_dim"] == 180
    assert cfg.data.data_dir == "datasets/era5"
    assert build_config("full_size").data.crop_size == 0 and build_config("full_size").train.batch_size == 1


def test_merge_from_base_and_overrides():
    cfg = build_config("quickstart", {"batch_size": "4", "model_args.depths": "[1, 1]", "model_args.num_heads": "2,2",
                                      "lr": "1e-3", "pin_memory": "false"})
    assert cfg.train.batch_size == 4 and cfg.train.lr == 1e-3 and cfg.data.pin_memory is False
    args = cfg.model.model_args  # the overridden ones, the quickstart's (over base's), and build's defaults
    assert (args["depths"], args["num_heads"], args["embed_dim"], args["window_size"]) == ([1, 1], [2, 2], 32, 8)
    assert args["img_range"] == 1.0 and args["resi_connection"] == "1conv" and len(args) == 10
    assert cfg.train.weight_decay == 1e-6  # inherited from base


def test_the_old_flat_model_keys_still_read_with_one_line(capsys, monkeypatch, tmp_path):
    # Old configs and checkpoints hold a built-in model's arguments as flat keys; each model's spec names its own.
    monkeypatch.setattr(config_files, "_told_moved", False)
    assert "embed_dim" not in KEYS and "embed_dim" in built_in("swinir").flat_keys and "widths" in old_flat_keys()
    cfg = build_config("quickstart", {"embed_dim": "24", "drop_path_rate": 0, "widths": [4]})
    assert cfg.model.model_args["embed_dim"] == 24 and cfg.model.model_args["depths"] == [2]
    assert cfg.model.model_args["drop_path_rate"] == 0.0 and "widths" not in cfg.model.model_args  # SwinIR has none
    both = build_config("quickstart", {"drop_path_rate": 0.5, "model_args": "{embed_dim: 8, depths: [1]}"})
    assert both.model.model_args["drop_path_rate"] == 0.5 and both.model.model_args["embed_dim"] == 8  # none lost
    unet = build_config("unet3d_quickstart", {"embed_dim": 24, "full_scale": True})  # a U-Net ignored embed_dim
    assert unet.model.model_args == {"widths": [16, 32, 64, 128], "full_scale": True}
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "--model_args.embed_dim on the command line" in err, err
    # a checkpoint of an older version: its config holds every flat key
    old = {**build_config("quickstart").to_dict(), "model_args": {}, **build_config("quickstart").model.model_args,
           "patch_size": 8, "widths": [64], "full_scale": True}
    check_model_settings(old, build_config("quickstart"), "old.pt")  # the same model: resumes
    with pytest.raises(CheckpointError, match=r"other settings: model_args.embed_dim 24 \(checkpoint: 32\);"):
        check_model_settings(old, cfg, "old.pt")
    read = config_from_checkpoint(Checkpoint(tmp_path / "old.pt", tmp_path, {**old, "embed_dim": 24}, 5, None),
                                  {}, ("sr",), "")
    assert read.model.model_args["embed_dim"] == 24 and "widths" not in read.model.model_args
    # an old config of yours over a project's config: its flat key wins over the base's model_args, as it did
    (tmp_path / "old.yaml").write_text("mine:\n  base: quickstart\n  embed_dim: 8\n  num_heads: [2]\n")
    mine = build_config("mine", path=tmp_path / "old.yaml").model.model_args
    assert (mine["embed_dim"], mine["num_heads"], mine["depths"]) == (8, [2], [2])


def test_an_old_flat_flag_says_where_it_moved(capsys):
    # The hidden flags are gone: the command line is where one writes anew, and one line says how.
    with pytest.raises(SystemExit) as stop:
        parse_config("", ["--config", "quickstart", "--embed_dim", "16"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--embed_dim is a model argument now: write --model_args.embed_dim VALUE (in a config: model_args: "
        "{embed_dim: VALUE})")


def test_model_args_are_checked_against_the_builder_in_one_line():
    for overrides, message in [({"model_args.embed_dims": 16}, "model_args embed_dims: not an argument of "
                                "models.swinir:build (it takes embed_dim, depths, num_heads, window_size"),
                               ({"model_args.depths": 2}, "model_args.depths: expected a list (its default is "),
                               ({"model_args.window_size": 0}, "window_size must be > 0, got 0"),
                               ({"model_args.upsampler": ""}, "upsampler '' keeps the input's grid")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_config("quickstart", overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"batch_sise": 4}, "unknown config key"),
    ({"batch_size": 0}, "batch_size must be > 0"),
    ({"batch_size": "many"}, "expected an integer"),
    ({"amp_dtype": "fp8"}, "not one of"),
    ({"crop_size": 63}, "divisible by upscale"),
    ({"model_args.depths": [2, 2, 2]}, "same length"),
    # The long-run keys: a timeout or an interval that cannot work is one line, not a traceback at the first step
    ({"dist_timeout_s": 0}, "dist_timeout_s must be > 0, got 0"),
    ({"dist_timeout_s": float("nan")}, "dist_timeout_s must be > 0, got nan"),
    ({"log_every": 0}, "log_every must be > 0, got 0"),
    ({"ckpt_every_minutes": float("inf")}, "ckpt_every_minutes must be >= 0, got inf"),
    ({"keep_checkpoints": -1}, "keep_checkpoints must be >= 0, got -1"),
])
def test_bad_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config("quickstart", overrides)


def test_unknown_name_lists_valid():
    with pytest.raises(ConfigError, match="valid: .*quickstart"):
        build_config("quikstart")


def test_every_field_documented():
    for cls in SECTIONS.values():
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_yaml_keys_are_known():
    for name, values in load_named_configs().items():
        assert set(values) <= set(KEYS), f"{name}: unknown keys {set(values) - set(KEYS)}"


def test_cli_errors_are_one_line():
    for argv in (["--config", "nope"], ["--bogus", "1"], ["--batch_size", "-1"]):
        proc = subprocess.run([sys.executable, "-m", "utils.config", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_script_defaults_sit_below_the_named_config_and_the_command_line():
    # train_with_profiling.py profiles unless told not to; train.py (no script default) does not.
    assert build_config("quickstart").profile.profile is False
    assert build_config("quickstart", script_defaults={"profile": True}).profile.profile is True
    assert build_config("quickstart", {"profile": False}, script_defaults={"profile": True}).profile.profile is False
    assert parse_config("", ["--config", "quickstart"], script_defaults={"profile": True}).profile.profile is True
    assert parse_config("", ["--profile", "false"], script_defaults={"profile": True}).profile.profile is False


@pytest.mark.parametrize("script, args, owner", [
    ("train.py", ["--config", "vit_quickstart", "--tp", "2"],
     "--tp 2 is applied by train_mp.py and estimate_memory.py only; train.py would"),
    ("train_ddp.py", ["--cp", "2"], "--cp 2 is applied by train_mp.py and estimate_memory.py only; train_ddp.py"),
    ("train_pp.py", ["--pp", "2", "--tp", "2"],
     "--tp 2 is applied by train_mp.py and estimate_memory.py only; train_pp.py would"),
    ("train_fsdp.py", ["--bucket_cap_mb", "50"], "--bucket_cap_mb 50.0 is applied by train_ddp.py only"),
    ("train_mp.py", ["--hsdp_replicas", "2"], "--hsdp_replicas 2 is applied by train_fsdp.py and estimate_memory.py"),
    ("train.py", ["--profile", "true"], "--profile true is applied by train_with_profiling.py only; train.py would"),
    ("train_with_profiling.py", ["--dist_timeout_s", "60"], "--dist_timeout_s 60.0 is applied by train_ddp.py and"),
    ("estimate_memory.py", ["--config", "vit_mp", "--pp", "2", "--pp_dp", "ddp", "--world_size", "4"],
     "estimate_memory.py does not model --pp_dp ddp (train_pp.py applies it): estimate without it"),
])
def test_a_key_the_script_would_ignore_is_refused_in_one_line(capsys, tmp_path, script, args, owner):
    code, err = exit_in_one_process(capsys, script, *args, "--run_dir", str(tmp_path / "run"))
    assert code == 2 and len(err) == 1 and owner in err[0], err
    assert not (tmp_path / "run").exists()


def test_keys_at_their_defaults_pass_and_the_table_names_real_keys_and_scripts():
    assert set(APPLIED_BY) <= set(KEYS) and all((REPO / s).is_file() for s in CHECKED_SCRIPTS)
    assert all(set(scripts) <= CHECKED_SCRIPTS for scripts in APPLIED_BY.values())
    with mock.patch.object(sys, "argv", ["train.py"]):
        assert parse_config("", ["--tp", "1", "--pp_schedule", "1f1b", "--profile", "false"]).dist.tp == 1
    with mock.patch.object(sys, "argv", ["train_with_profiling.py"]):  # its own default (profile) is not "set"
        assert parse_config("", [], script_defaults={"profile": True}).profile.profile is True


def test_each_technique_declares_its_keys_beside_it():
    # utils/config.py reads each file's APPLIED_BY from its text (the ground floor imports no technique): what it reads
    # is what the file, imported, holds.
    from utils.parallel import fsdp, pipeline_parallel, tensor_parallel  # noqa: PLC0415 (torch: this test only)

    assert APPLIED_BY["tp"] == ("train_mp.py", "estimate_memory.py") == tensor_parallel.APPLIED_BY["tp"]
    assert APPLIED_BY["hsdp_replicas"] == fsdp.APPLIED_BY["hsdp_replicas"] == ("train_fsdp.py", "estimate_memory.py")
    assert all(APPLIED_BY[key] == ("train_pp.py",) for key in ("pp_split", "pp_dp"))
    assert ("pp_split", "pp_dp") in pipeline_parallel.APPLIED_BY and APPLIED_BY["profile"] == ("train_with_profiling.py",)


@pytest.mark.parametrize("layout, said", [(["--cp", "4"], "each field in 4 bands (cp)"),
                                          (["--tp", "2"], "each block split over 2 ranks (tp)"),
                                          (["--pp", "2", "--pp_microbatches", "4"],
                                           "2 pipeline stages (1f1b, 4 microbatches)")])
def test_the_model_parallel_layouts_are_estimated_as_themselves(capsys, layout, said):
    assert estimate_memory.main(["--config", "vit_mp", *layout, "--world_size", "4", "--strategy", "fsdp"]) == 0
    assert f"4 ranks, strategy fsdp, {said}" in capsys.readouterr().out.splitlines()[0]


def test_under_torchrun_only_rank_0_prints_a_config_error(capsys, monkeypatch):
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        with mock.patch.object(sys, "argv", ["train_ddp.py"]), pytest.raises(SystemExit) as stop:
            parse_config("", ["--cp", "2"])
        assert stop.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == lines


def test_negative_numbers_are_values_and_help_names_each_default_once(capsys):
    with pytest.raises(SystemExit):
        parse_config("", ["--lr", "-1e-3"])
    assert capsys.readouterr().err.strip().endswith("error: lr must be > 0, got -0.001")
    assert parse_config("", ["--lr=2e-3", "--lr_gamma", "-.5e0", "--lr_gamma", ".5"]).train.lr_gamma == 0.5
    with pytest.raises(SystemExit):
        parse_config("", ["--help"])
    assert capsys.readouterr().out.count("(default: quickstart)") == 1

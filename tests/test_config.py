"""Named configs, overrides, types and errors."""

import subprocess
import sys

import pytest

from utils.config import KEYS, SECTIONS, ConfigError, build_config, field_docs, load_named_configs, parse_config
from tests.conftest import REPO

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
    assert cfg.model.depths == [6] * 6 and cfg.model.embed_dim == 180 and cfg.data.data_dir == "datasets/era5"
    assert build_config("full_size").data.crop_size == 0 and build_config("full_size").train.batch_size == 1


def test_merge_from_base_and_overrides():
    cfg = build_config("quickstart", {"batch_size": "4", "depths": "[1, 1]", "num_heads": "2,2", "lr": "1e-3",
                                      "pin_memory": "false"})
    assert cfg.train.batch_size == 4 and cfg.model.depths == [1, 1] and cfg.model.num_heads == [2, 2]
    assert cfg.train.lr == 1e-3
    assert cfg.data.pin_memory is False
    assert cfg.train.weight_decay == 1e-6  # inherited from base


@pytest.mark.parametrize("overrides, message", [
    ({"batch_sise": 4}, "unknown config key"),
    ({"batch_size": 0}, "batch_size must be > 0"),
    ({"batch_size": "many"}, "expected an integer"),
    ({"amp_dtype": "fp8"}, "not one of"),
    ({"crop_size": 63}, "divisible by upscale"),
    ({"depths": [2, 2, 2]}, "same length"),
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
        proc = subprocess.run([sys.executable, "-m", "utils.config", *argv], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_script_defaults_sit_below_the_named_config_and_the_command_line():
    # train_with_profiling.py profiles unless told not to; train.py (no script default) does not.
    assert build_config("quickstart").profile.profile is False
    assert build_config("quickstart", script_defaults={"profile": True}).profile.profile is True
    assert build_config("quickstart", {"profile": False}, script_defaults={"profile": True}).profile.profile is False
    assert parse_config("", ["--config", "quickstart"], script_defaults={"profile": True}).profile.profile is True
    assert parse_config("", ["--profile", "false"], script_defaults={"profile": True}).profile.profile is False

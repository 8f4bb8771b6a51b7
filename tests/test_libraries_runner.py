"""The runner of `make test-libraries` (tests/libraries.py), without the libraries (they live in .venv-libraries): each
model goes through every script the issue names, its configs name the libraries' classes and nothing of the
project's, its pins stay apart from the project's lock, and the resume it checks compares the right runs."""

from __future__ import annotations

from pathlib import Path

from tests import libraries as lib
from tests import smoke as runner
from utils.config_files import load_named_configs

SCRIPTS = {"train.py", "train_ddp.py", "train_fsdp.py", "estimate_memory.py", "plan.py", "check_layouts.py",
           "predict.py", "tests/same_checkpoints.py"}


def args_of(smoke: runner.Smoke) -> dict[str, str]:
    """--key value pairs of a command (a flag without a value maps to "")."""
    args, pairs = list(smoke.args), {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            pairs[arg[2:]] = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
    return pairs


def test_each_model_goes_through_every_script_on_its_data():
    names = [s.name for s in lib.SMOKES]
    assert len(names) == len(set(names))
    for i, smoke in enumerate(lib.SMOKES):
        assert (lib.REPO / smoke.script).is_file(), smoke.script
        assert all(need in names[:i] for need in smoke.needs), f"{smoke.name} runs before what it needs"
    for name, (data, _) in lib.MODELS.items():
        own = [s for s in lib.SMOKES if s.name.startswith(f"{name}_")]
        assert {s.script for s in own} == SCRIPTS, name
        trained = [s for s in own if s.script.startswith("train")]
        assert all(args_of(s)["data_dir"] == f"{{run:{data}}}" and data in s.needs for s in trained)
        assert [s.script for s in own if s.torchrun] == ["train_ddp.py", "train_fsdp.py", "train_fsdp.py",
                                                         "train_fsdp.py"]
        assert all(args_of(s)["ac"] == "block" for s in own if s.script in ("train_fsdp.py", "check_layouts.py"))
    # The traced estimate against the measured peak: every model, one process and FSDP on 2, AC as trained.
    after = {flag: [b for a, b in zip(lib.MEMORY.args, lib.MEMORY.args[1:]) if a == flag] for flag in ("--config",
                                                                                                       "--layout")}
    assert after == {"--config": list(lib.MODELS), "--layout": ["1,none,ac=block", "2,fsdp,ac=block"]}


def test_the_resume_compared_is_a_run_stopped_half_way_against_the_uninterrupted_one(tmp_path):
    for name in lib.MODELS:
        by_name = {s.name: s for s in lib.SMOKES}
        straight, half, resumed = (by_name[f"{name}_{what}"] for what in ("fsdp", "fsdp_half", "fsdp_resumed"))
        assert args_of(half)["max_steps"] == "3" and "max_steps" not in args_of(straight)
        assert args_of(resumed)["resume"] == "true" and args_of(resumed)["run_dir"] == f"{{run:{half.name}}}"
        same = runner.command(by_name[f"{name}_same_bits"], Path("python"), tmp_path)[2:]
        assert same == [str(tmp_path / straight.name), str(tmp_path / half.name)]
    # The configs: 6 steps straight, a checkpoint at step 3, and a schedule that max_steps does not change (a run
    # told to stop at 3 steps must take the same first 3 as one told 6).
    run = load_named_configs(lib.REPO / lib.CONFIGS)["_run"]
    assert (run["max_steps"], run["ckpt_every"], run["lr_schedule"]) == (6, 3, "exponential")


def test_the_configs_name_the_libraries_classes_alone():
    configs = load_named_configs(lib.REPO / lib.CONFIGS)
    modules = tuple(lib.IMPORTS.values())
    for name in lib.MODELS:
        chain, config = [name], configs[name]
        while config.get("model_class") is None:  # from its base in the same file
            chain.append(config["base"])
            config = configs[chain[-1]]
        assert config["model_class"].split(".")[0].split(":")[0] in modules, (name, config["model_class"])


def test_the_pins_are_the_libraries_and_nothing_the_project_pins():
    pins = lib.pinned(lib.PINS.read_text())
    assert set(lib.IMPORTS) <= set(pins)
    ours = lib.pinned((lib.REPO / "constraints.txt").read_text())
    assert not set(pins) & set(ours), "pinned in both files: the project's environment decides, leave it to the lock"
    base = Path("/some/venv/site-packages")
    assert lib.stamp(base).endswith(f"over {base}") and lib.stamp(base) != lib.stamp(Path("/another"))

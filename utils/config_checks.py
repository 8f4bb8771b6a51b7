"""Value checks of a config that types alone do not catch (utils/config.py builds the config, then calls
:func:`validate`); checks against the data are utils.data.era5.resolve_from_data's.

Every model's arguments (``model_args``) are checked against its builder's signature here, and by its spec's own
check (the built-in models': heads that divide their width, ...); the model contract is checked when it is built.
"""

from __future__ import annotations

import dataclasses
import math

from utils.config_files import ConfigError


def validate_ensemble(e) -> None:
    """ConfigError for an ensemble section (utils.config.EnsembleConfig) whose values cannot work."""
    if not (0 <= e.noise_scale < math.inf and 0 < e.correlation_km < math.inf and e.bred_cycles >= 1):
        raise ConfigError(f"noise_scale must be >= 0, correlation_km > 0 and bred_cycles >= 1, got {e.noise_scale}, "
                          f"{e.correlation_km}, {e.bred_cycles}")


def validate(cfg) -> None:
    """ConfigError for the first value of ``cfg`` (a utils.config.Config) that cannot work; fills in a built-in
    model's model_class."""
    d, m, t = cfg.data, cfg.model, cfg.train
    values = {**dataclasses.asdict(m), **dataclasses.asdict(d), **dataclasses.asdict(t), **dataclasses.asdict(cfg.dist)}
    for key in ("batch_size", "upscale", "lead", "in_chans", "n_patches", "out_chans", "log_every", "dist_timeout_s"):
        if not 0 < values[key] < math.inf:  # NaN too
            raise ConfigError(f"{key} must be > 0, got {values[key]}")
    for key in ("max_steps", "epochs", "val_every", "ckpt_every", "ckpt_every_minutes", "keep_checkpoints",
                "num_workers", "train_samples", "val_samples", "val_batch_size", "crop_size"):
        if not 0 <= values[key] < math.inf:
            raise ConfigError(f"{key} must be >= 0, got {values[key]}")
    validate_ensemble(cfg.ensemble)
    if t.max_steps == 0 and t.epochs == 0:
        raise ConfigError("set epochs > 0 or max_steps > 0")
    if d.task == "sr" and d.crop_size and d.crop_size % m.upscale:
        raise ConfigError(f"crop_size {d.crop_size} must be divisible by upscale {m.upscale}")
    if d.task in ("forecast", "diagnostic") and d.crop_size:
        raise ConfigError(f"task {d.task} trains and validates on whole fields (latitude weights, climatology): "
                          f"set crop_size 0, not {d.crop_size}")
    _validate_channel_sets(d)
    if len(m.img_size) not in (1, 2) or min(m.img_size) <= 0:
        raise ConfigError(f"img_size must be [height, width] or [side] with positive sides, got {m.img_size}")
    _validate_model_class(m)
    _validate_model(cfg)
    if d.task == "volume":
        _validate_volume(cfg)
    elif t.lambda_rho:
        raise ConfigError(f"lambda_rho weighs the density of task volume (SC22's U-Net); task {d.task} has none: set 0")
    if cfg.dist.tp < 1 or cfg.dist.cp < 1:
        raise ConfigError(f"tp and cp must be >= 1, got tp {cfg.dist.tp}, cp {cfg.dist.cp}")
    if cfg.dist.pp < 1 or cfg.dist.pp_microbatches < 1 or any(n < 1 for n in cfg.dist.pp_split):
        raise ConfigError(f"pp and pp_microbatches must be >= 1 and pp_split entries >= 1, got pp {cfg.dist.pp}, "
                          f"pp_microbatches {cfg.dist.pp_microbatches}, pp_split {cfg.dist.pp_split}")
    if sorted(cfg.dist.parallel_order.split("-")) not in (["cp", "dp", "tp"], ["cp", "dp", "ens", "tp"]):
        raise ConfigError(f"parallel_order must name tp, cp and dp once each (and ens, or not), joined by '-' (e.g. "
                          f"tp-cp-dp), got {cfg.dist.parallel_order!r}")
    _validate_ensemble_training(t, cfg.dist)
    if len(m.mean) != len(m.std) or (m.mean and len(m.mean) != m.in_chans):
        raise ConfigError(f"mean and std need {m.in_chans} values each (in_chans), or both empty "
                          f"(= from <data_dir>/stats); got {len(m.mean)} and {len(m.std)}")
    if any(s <= 0 for s in m.std):
        raise ConfigError(f"std must be > 0, got {m.std}")
    if len(m.out_mean) != len(m.out_std) or (m.out_mean and len(m.out_mean) != cfg.target_chans):
        raise ConfigError(f"out_mean and out_std need {cfg.target_chans} values each (the targets' channels), or both "
                          f"empty (= from the data); got {len(m.out_mean)} and {len(m.out_std)}")
    if any(s <= 0 for s in m.out_std):
        raise ConfigError(f"out_std must be > 0, got {m.out_std}")
    # the metrics' channels
    named, key = (m.out_chans, "out_chans") if d.task in ("volume", "diagnostic") else (m.in_chans, "in_chans")
    if d.channel_names and len(d.channel_names) != named:
        raise ConfigError(f"channel_names has {len(d.channel_names)} names but {key} is {named}")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {t.betas}")
    if t.cuda_graphs and not (t.compile and t.compile_backend == "inductor"):
        raise ConfigError("cuda_graphs replays what torch.compile's inductor captured: add --compile true "
                          "--compile_backend inductor (or drop --cuda_graphs)")
    _validate_keep_fp32(cfg)
    if t.lr <= 0:
        raise ConfigError(f"lr must be > 0, got {t.lr}")
    if cfg.dist.base_batch_size <= 0 or cfg.dist.warmup_steps < 0:
        raise ConfigError(f"base_batch_size must be > 0 and warmup_steps >= 0, got {cfg.dist.base_batch_size} and "
                          f"{cfg.dist.warmup_steps}")


def _validate_ensemble_training(t, d) -> None:
    """The CRPS needs members, and members need the CRPS; ens shares them out evenly."""
    if t.ensemble < 1 or d.ens < 1:
        raise ConfigError(f"ensemble and ens must be >= 1, got ensemble {t.ensemble}, ens {d.ens}")
    if (t.loss == "crps") != (t.ensemble > 1):
        raise ConfigError(f"loss crps compares the members of an ensemble and an ensemble trains on the CRPS: set "
                          f"--loss crps with --ensemble 2 or more (got loss {t.loss}, ensemble {t.ensemble})")
    if t.ensemble % d.ens:
        raise ConfigError(f"ens {d.ens} must divide ensemble {t.ensemble}: each ens rank holds as many members")
    if not (0 < t.crps_alpha <= 1 and 0 <= t.member_noise < math.inf):
        raise ConfigError(f"crps_alpha must be in (0, 1] and member_noise >= 0, got {t.crps_alpha} and "
                          f"{t.member_noise}")


def _validate_keep_fp32(cfg) -> None:
    t = cfg.train
    if t.fp32_modules and not t.keep_fp32:
        raise ConfigError("fp32_modules names the parts keep_fp32 keeps in fp32: add --keep_fp32 true (or drop "
                          "--fp32_modules)")
    if t.keep_fp32 and t.amp_dtype == "none":
        raise ConfigError("keep_fp32 keeps parts of the model in fp32 under autocast; without --amp_dtype everything "
                          "is fp32 already: add --amp_dtype bf16 (or drop --keep_fp32)")
    if t.keep_fp32 and cfg.dist.param_dtype != "fp32":
        raise ConfigError(f"keep_fp32 runs the kept parts with fp32 weights; param_dtype {cfg.dist.param_dtype} "
                          "hands FSDP2's units bf16 ones: use --param_dtype fp32 with --amp_dtype (or drop --keep_fp32)")


def _built_in_names() -> list[str]:
    from models.spec import built_in_names  # noqa: PLC0415 (the folders of models/: no torch needed, but the package)
    return built_in_names()


def _validate_model_class(m) -> None:
    """A built-in model by name, or yours by model_class (then under a name of its own); fills in model_class."""
    built_in = _built_in_names()
    if not m.model_class:
        if m.model not in built_in:
            raise ConfigError(f"model {m.model!r} is not one of the built-in models ({', '.join(built_in)}): "
                              "name its class with model_class: module:Class (docs/part4-your-model.md)")
        m.model_class = _built_in_spec(m.model).build
    elif m.model in built_in and m.model_class != _built_in_spec(m.model).build:
        raise ConfigError(f"model {m.model!r} is the built-in one, but model_class is {m.model_class}: give your "
                          f"model a name of its own (e.g. model: {m.model_class.split(':')[-1].lower()})")
    if m.model_class.count(":") != 1 or not all(m.model_class.split(":")):
        raise ConfigError(f"model_class must be module:Class (e.g. fno:FNO2d), got {m.model_class!r}")


def built_in_flat_keys() -> frozenset[str]:
    """The old flat config keys of the built-in models' arguments, as their specs name them."""
    from models.spec import old_flat_keys  # noqa: PLC0415 (imports every built-in model's folder, torch with it)
    return old_flat_keys()


def _built_in_spec(name: str):
    from models.spec import built_in  # noqa: PLC0415 (a built-in model's folder imports torch: only here)
    return built_in(name)


def _validate_model(cfg) -> None:
    """The model's arguments (model_args over its builder's defaults, stored back), and what its spec says: the tasks
    it trains on, and its own checks of its arguments (models/<name>/spec.py)."""
    from models import resolve  # noqa: PLC0415 (the model's module, and torch with it: only once a config is checked)
    try:
        found = resolve(cfg.model)  # once per process: every later reader of the model takes it from there
        takes = found.accepted if cfg.moved else None
        if takes is not None:  # an old flat key the model does not take was ignored: it still is
            cfg.model.model_args = {k: v for k, v in cfg.model.model_args.items() if k in takes or k not in cfg.moved}
        cfg.model.model_args = found.arguments(cfg.model.model_args, cfg.model.model_class)
    except ValueError as error:  # models.ModelError: one line that says what to do
        raise ConfigError(str(error)) from None
    spec = found.spec
    if cfg.data.task not in spec.tasks:
        raise ConfigError(f"model {cfg.model.model} trains on task {' or '.join(spec.tasks)}, not {cfg.data.task}: use "
                          f"task {spec.tasks[0]} (--task {spec.tasks[0]}), or a model whose spec's tasks include "
                          f"{cfg.data.task} (models/spec.py)")
    try:
        if spec.check is not None:
            spec.check(cfg)
    except ConfigError:
        raise
    except ValueError as error:  # a spec's check says what is wrong in plain ValueErrors (models/ imports no utils/)
        raise ConfigError(str(error)) from None


def _validate_volume(cfg) -> None:
    """Task volume trains on the stored (already scaled) fields with SC22's loss."""
    t, m = cfg.train, cfg.model
    if m.mean or m.std or m.out_mean or m.out_std:  # they would standardise a model that takes none (models/adapt.py)
        raise ConfigError("task volume trains on the stored (already scaled) fields, which have no statistics: leave "
                          "mean, std, out_mean and out_std empty")
    if t.lambda_rho < 0:
        raise ConfigError(f"lambda_rho must be >= 0, got {t.lambda_rho}")
    if t.loss != "l1" or t.loss_space != "physical":
        raise ConfigError(f"task volume trains with SC22's L1 loss on the stored (already scaled) fields: set loss l1 "
                          f"and loss_space physical, not {t.loss} / {t.loss_space}")


def take_channel_sets(cfg, origin: dict[str, int]) -> None:
    """Task diagnostic, on any base config: in_chans and out_chans count input_channels and target_channels, the
    metrics' channels are the targets (channel_names; key_channels: the base's among them, else the first three).

    Which wins follows where each key was said (``origin``: utils/config_files.py's named_config, the command line
    last). A key said with its channel set or after it (the same config, one built on it, the command line) is the
    user's: if it disagrees, one line names both keys. One said before it belongs to a base's own data and gives
    way, the base's statistics with it (mean/std, out_mean/out_std: then the data's, utils/data/era5.py)."""
    d, m = cfg.data, cfg.model
    if d.task != "diagnostic" or not d.input_channels or not d.target_channels:
        return  # _validate_channel_sets says what is missing

    def said_with(key: str, channel_set: str) -> bool:
        return origin.get(key, -1) >= origin.get(channel_set, -1)

    for section, key, channel_set, value in ((m, "in_chans", "input_channels", len(d.input_channels)),
                                             (m, "out_chans", "target_channels", len(d.target_channels)),
                                             (d, "channel_names", "target_channels", list(d.target_channels))):
        if getattr(section, key) == value:
            continue
        if said_with(key, channel_set):
            names = getattr(d, channel_set)
            raise ConfigError(f"{key} {_shown(getattr(section, key))} disagrees with {channel_set} {_shown(names)} "
                              f"({len(names)} channel{'s' * (len(names) != 1)}): task diagnostic takes {key} from "
                              f"{channel_set}; drop {key}")
        setattr(section, key, value)
    for keys, channel_set in ((("mean", "std"), "input_channels"), (("out_mean", "out_std"), "target_channels")):
        if not any(said_with(key, channel_set) for key in keys):
            for key in keys:
                setattr(m, key, [])
    others = [name for name in d.key_channels if name not in d.target_channels]
    if others and said_with("key_channels", "target_channels"):
        raise ConfigError(f"key_channels {_shown(others)} are not among target_channels {_shown(d.target_channels)}: "
                          "task diagnostic reports its targets; name key_channels among them, or drop key_channels")
    d.key_channels = [name for name in d.key_channels if name in d.target_channels] or d.target_channels[:3]


def _shown(value) -> str:
    return f"[{', '.join(map(str, value))}]" if isinstance(value, list) else str(value)


def _validate_channel_sets(d) -> None:
    """Task diagnostic names its inputs and targets (the data's channel names); no other task has channel sets."""
    if d.task != "diagnostic":
        if d.input_channels or d.target_channels:
            raise ConfigError(f"input_channels and target_channels are for task diagnostic; task {d.task} maps all "
                              "the data's channels: leave them empty, or set --task diagnostic")
        return
    if not d.input_channels or not d.target_channels:
        raise ConfigError("task diagnostic computes target_channels from input_channels at the same time: name both, "
                          "e.g. --input_channels '[t850, r850]' --target_channels '[tcwv]'")
    for key, names in (("input_channels", d.input_channels), ("target_channels", d.target_channels)):
        if len(set(names)) != len(names):
            raise ConfigError(f"{key} names a channel twice: {names}")

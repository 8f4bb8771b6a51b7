"""Where named configs come from: every ``config/*.yaml`` of the project, and a file of your own anywhere
(``--config_file PATH``), whose configs may start from any named config with the key ``base: NAME``.

``base`` crosses files, which YAML's merge key (``<<: *anchor``, used inside the project's files) cannot: a config
of yours says ``base: vit_quickstart`` and then only what it changes. Bases chain (a base may have its own); a
config's own keys win over its base's, ``model_args`` as a whole, and a config that names another model does not
take its base's model_args at all (:func:`over`). The folder of your file goes on ``sys.path``, so that a ``model_class``
whose module lies beside the config imports without installing anything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
BASE_KEY = "base"


class ConfigError(ValueError):
    """A config problem, reported as one line that says what to do."""


class _OwnKeysLoader(yaml.SafeLoader):
    """Reads mappings without YAML's merge key (``<<: *base``): what each named config says itself, beside what it
    merged in (:func:`named_config`'s ``origin``)."""

    def flatten_mapping(self, node):
        node.value = [(key, value) for key, value in node.value if key.tag != "tag:yaml.org,2002:merge"]


def load_named_configs(path: Optional[Path] = None, own: bool = False) -> dict[str, dict[str, Any]]:
    """All named configs of one YAML file, or of every ``config/*.yaml`` when ``path`` is None
    (a name defined in two files is an error); ``own``: each config's own keys only, without those it merges in."""
    if path is None:
        merged: dict[str, dict[str, Any]] = {}
        for file in sorted(CONFIG_DIR.glob("*.yaml")):
            configs = load_named_configs(file, own)
            twice = sorted(set(configs) & set(merged))
            if twice:
                raise ConfigError(f"config name(s) {', '.join(twice)} defined twice in {CONFIG_DIR}: rename one")
            merged.update(configs)
        return merged
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            configs = yaml.load(f, _OwnKeysLoader if own else yaml.SafeLoader)  # noqa: S506 (both are safe)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ConfigError(f"{path} must map config names to mappings of keys")
    return configs


def named_config(name: str, path: Optional[Path] = None, fold: Optional[Callable[[dict], dict]] = None,
                 origin: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """The keys of config ``name`` (from ``path``, else the project's files) with its bases merged in (:func:`over`),
    without the ``base`` key itself. A name in ``path`` hides the project's config of the same name. ``fold`` reads
    each config's old keys before it is merged (utils/config.py: fold_old_keys); ``origin`` gets each key's
    depth, higher where it was said later: the farthest base's merged-in keys (``<<:``) 0, its own 1, the next
    config's merged-in keys 2, ... (which keys follow which: utils/config_checks.py's take_channel_sets)."""
    configs = load_named_configs()
    if path is not None:
        configs = {**configs, **load_named_configs(path)}
    chain: list[str] = []
    while True:
        if name not in configs:
            where = f"{path.name} or {CONFIG_DIR.name}/*.yaml" if path else f"{CONFIG_DIR.name}/*.yaml"
            valid = ", ".join(n for n in configs if n != "base" and not n.startswith("_"))
            said = f"base {name!r} of config {chain[-1]!r}" if chain else f"config {name!r}"
            raise ConfigError(f"unknown {said} in {where}; valid: {valid}")
        if name in chain:
            raise ConfigError(f"configs {' -> '.join(chain + [name])} name each other as base: break the circle")
        chain.append(name)
        base = configs[name].get(BASE_KEY)
        if base is None:
            break
        name = str(base)
    own = {**load_named_configs(own=True), **(load_named_configs(path, own=True) if path is not None else {})} \
        if origin is not None else {}
    values: dict[str, Any] = {}
    for depth, link in enumerate(reversed(chain)):  # the farthest base first: each config's own keys win
        keys = {k: v for k, v in configs[link].items() if k != BASE_KEY}
        keys = fold(keys) if fold is not None else keys
        values = over(values, keys)
        if origin is not None:
            origin.update({key: 2 * depth + (key in own[link]) for key in keys})
    return values


def names_another_model(values: dict[str, Any], own: dict[str, Any]) -> bool:
    """Whether ``own`` (a config over its base, or overrides over a config) names another model than ``values``."""
    return any(key in own and own[key] != values.get(key) for key in ("model", "model_class"))


def over(values: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``own``'s keys over ``values``'s, model_args name by name (as --model_args.NAME is). The model's arguments
    belong to its model: a config that names another model than its base does not take the base's model_args (another
    model's arguments mean nothing to yours)."""
    merged = {**values, **own}
    base = {} if names_another_model(values, own) else values.get("model_args", {})
    if isinstance(base, dict) and isinstance(own.get("model_args", {}), dict):  # else build_config says what is wrong
        merged["model_args"] = {**base, **own.get("model_args", {})}
    return merged


_told_moved = False


def fold_into_model_args(values: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``values`` (a config's keys, overrides or a checkpoint's config) with the keys ``names`` (old flat keys of a
    model's arguments: utils/config.py's fold_old_keys finds them) moved under model_args, whose own entries win;
    said once per process, by rank 0."""
    if not names:
        return values
    global _told_moved
    if not _told_moved and os.environ.get("RANK", "0") == "0":
        print(f"note: {', '.join(names)} {'is a model argument' if len(names) == 1 else 'are model arguments'} now, "
              f"read as such: write --model_args.{names[0]} on the command line, model_args: {{{names[0]}: ...}} in a "
              "config", file=sys.stderr)
        _told_moved = True
    args = values.get("model_args") or {}
    if not isinstance(args, dict):
        return values  # build_config says what is wrong with model_args
    folded = {k: v for k, v in values.items() if k not in names}
    folded["model_args"] = {**{k: values[k] for k in names}, **args}
    return folded

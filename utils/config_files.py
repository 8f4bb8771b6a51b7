"""Where named configs come from: every ``config/*.yaml`` of the project, and a file of your own anywhere
(``--config_file PATH``), whose configs may start from any named config with the key ``base: NAME``.

``base`` crosses files, which YAML's merge key (``<<: *anchor``, used inside the project's files) cannot: a config
of yours says ``base: vit_quickstart`` and then only what it changes. Bases chain (a base may have its own); a
config's own keys win over its base's. The folder of your file goes on ``sys.path``, so that a ``model_class``
whose module lies beside the config imports without installing anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
BASE_KEY = "base"


class ConfigError(ValueError):
    """A config problem, reported as one line that says what to do."""


def load_named_configs(path: Optional[Path] = None) -> dict[str, dict[str, Any]]:
    """All named configs of one YAML file, or of every ``config/*.yaml`` when ``path`` is None
    (a name defined in two files is an error)."""
    if path is None:
        merged: dict[str, dict[str, Any]] = {}
        for file in sorted(CONFIG_DIR.glob("*.yaml")):
            configs = load_named_configs(file)
            twice = sorted(set(configs) & set(merged))
            if twice:
                raise ConfigError(f"config name(s) {', '.join(twice)} defined twice in {CONFIG_DIR}: rename one")
            merged.update(configs)
        return merged
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    with open(path) as f:
        try:
            configs = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
        raise ConfigError(f"{path} must map config names to mappings of keys")
    return configs


def named_config(name: str, path: Optional[Path] = None) -> dict[str, Any]:
    """The keys of config ``name`` (from ``path``, else the project's files) with its bases merged in, without
    the ``base`` key itself. A name in ``path`` hides the project's config of the same name."""
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
    values: dict[str, Any] = {}
    for link in reversed(chain):  # the farthest base first: each config's own keys win
        values.update({k: v for k, v in configs[link].items() if k != BASE_KEY})
    return values

"""What is model-specific in the parallel techniques: each model's plan, read from its spec (models/spec.py).

The techniques (``techniques.py``: AC and compile; ``fsdp.py``; ``tensor_parallel.py``;
``context_parallel.py`` and ``domain_parallel.py``; ``pipeline_parallel.py``) are written once for every
model and read only a model's plan; the models themselves know nothing of parallelism. Each plan is declared
beside its model, in the model's spec (the built-in ones in ``models/<name>/spec.py``); a model of yours declares
its own where it is defined (the module that ``model_class`` names, which the scripts import before anything reads
the plan)::

    from utils.parallel.plans import ModelPlan, register_plan
    register_plan(FNO2d, ModelPlan(units={"block": lambda model: model.blocks()}))

A model with no plan gets its units from its ``blocks()``, if it has that method (the model contract:
docs/part4-your-model.md), and nothing else. A plan may leave a technique out (None), and the technique then
refuses the model in one line that names it and the missing plan. What each field of a plan means:
models/spec.py.
"""

from __future__ import annotations

from torch import nn

from models import config_spec
from models.spec import (UNITS, FieldPlan, ModelPlan, StagePlan, TensorParallelPlan, TokenPlan, class_spec,
                         register_plan)
from utils.config import ConfigError

__all__ = ["UNITS", "FieldPlan", "ModelPlan", "StagePlan", "TensorParallelPlan", "TokenPlan", "ac_units",
           "class_plan", "config_plan",
           "missing_plan", "model_plan", "register_plan"]


def model_plan(model: nn.Module) -> ModelPlan:
    """The plan registered for the model's class (or a base class); else units from its ``blocks()``, if any."""
    return class_plan(type(model))


def class_plan(model_class: type) -> ModelPlan:
    """:func:`model_plan` before the model is built (the loaders of a model whose fields are split need it)."""
    return class_spec(model_class).plan


def config_plan(model_cfg) -> ModelPlan:
    """The plan of the model a config's model section builds (its class, imported as build_model would)."""
    return config_spec(model_cfg).plan


def missing_plan(model: nn.Module, what: str, flag: str) -> ConfigError:
    """The one line of a technique that the model's plan leaves out."""
    name = type(model).__name__
    return ConfigError(f"the {name} has no {what} plan: use {flag}, or declare one beside the model "
                       f"(register_plan({name}, ModelPlan(...)): utils/parallel/plans.py, docs/part4-your-model.md)")


def ac_units(model: nn.Module, unit: str, required: bool = True) -> list[nn.Module]:
    """The modules a technique wraps one by one (AC, FSDP2): unit "block" or "layer" of the model's row. ``required``:
    a model without units refuses in one line (AC has nothing to checkpoint); else it has none (FSDP2 and compile
    then take the model whole)."""
    if unit not in UNITS:
        raise ValueError(f"unit must be 'block' or 'layer', got {unit!r}")
    units = model_plan(model).units
    found = list(units[unit](model)) if unit in units else []
    if units and unit not in units:
        name, have = type(model).__name__, " and ".join(f"{u}s" for u in units)
        fix = " / ".join(f"--ac {u} / --fsdp_unit {u}" for u in units)
        raise ConfigError(f"unit {unit!r} is not one of the {name}'s units: the {name} has {have} only: use {fix}")
    if not found and required:  # no plan with units, or a default plan that found no parts with parameters
        raise missing_plan(model, "unit (blocks() returning its repeated layers, or a plan with units)", "--ac none")
    return found

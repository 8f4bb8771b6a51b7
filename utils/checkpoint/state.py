"""What every checkpoint holds besides the weights, whichever kind writes it (single.py, sharded.py): where training
is (:class:`TrainState`), the state of every random generator, the model settings a resume must match, and state
dict keys without the prefixes that wrappers add."""

from __future__ import annotations

import collections
import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from utils.checkpoint.files import CheckpointError
from utils.config import fold_old_keys

WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Key components added by DDP / DataParallel, torch.compile, activation checkpointing and FSDP1."""


@dataclass
class TrainState:
    """Where training is: enough, with the RNG states, to continue exactly."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current epoch."""
    batch_in_epoch: int = 0
    """Batches of the current epoch already consumed."""


def check_model_settings(saved: dict, cfg, path) -> None:
    """A resume must build the model that the checkpoint holds: name the model keys (and model_args) whose values
    differ; a checkpoint of an older version gives its model's arguments as flat keys."""
    saved = fold_old_keys(saved)
    differ = [f"{f.name} {getattr(cfg.model, f.name)!r} (checkpoint: {saved[f.name]!r})"
              for f in dataclasses.fields(cfg.model) if f.name in saved and f.name not in ("model_path", "model_args")
              and saved[f.name] != getattr(cfg.model, f.name)]  # model_path: where, not what
    args, held = cfg.model.model_args, saved.get("model_args") or {}
    differ += [f"model_args.{k} {args[k]!r} (checkpoint: {held[k]!r})"
               for k in args if k in held and args[k] != held[k]]
    if differ:
        raise CheckpointError(f"{path} holds a model built with other settings: {', '.join(differ)}; a resumed run "
                              "must use the run's model settings (drop those overrides)")


def capture_rng_state() -> dict:
    """The state of every random generator a training step may draw from.

    Python ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is
    available, the generator of every visible GPU. NumPy's key is stored as an int64 tensor so
    the result loads with weights_only=True.
    """
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore generators captured by :func:`capture_rng_state`.

    CUDA states are restored for as many GPUs as both the checkpoint and this process have
    (none when resuming a GPU run on CPU or the other way round).
    """
    random.setstate(_as_python_random_state(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), index)


def _as_python_random_state(saved) -> tuple:
    # random.setstate insists on tuples; be lenient if a state went through JSON or lists.
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


def model_state(model) -> dict:
    """The model's weights as a checkpoint holds them: under their plain names (:func:`strip_wrapper_prefixes`),
    tensors only (:func:`tensors_only`)."""
    return tensors_only(strip_wrapper_prefixes(model.state_dict()))


def tensors_only(state_dict: dict) -> dict:
    """``state_dict`` (a copy, in order) without the entries that are not tensors. A library's ``state_dict`` may add
    some (neuraloperator's models: ``_metadata``, their constructor's arguments, a function among them), which a file
    that loads with ``weights_only=True`` cannot hold, nor a DCP folder exported to one; the run's config holds the
    model's arguments, and the library's ``load_state_dict`` goes without them."""
    kept = collections.OrderedDict((k, v) for k, v in state_dict.items() if isinstance(v, torch.Tensor))
    metadata = getattr(state_dict, "_metadata", None)  # the module versions load_state_dict reads
    if metadata is not None:
        kept._metadata = metadata
    return kept


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    """A copy of ``state_dict`` with the key components that wrappers add removed.

    ``module.`` (DDP), ``_orig_mod.`` (torch.compile), ``_checkpoint_wrapped_module.``
    (activation checkpointing) and ``_fsdp_wrapped_module.`` are removed wherever they appear as
    whole dot-separated components, so a state saved from any wrapped model loads into the plain
    one. Keeps the order and the ``_metadata`` (module versions) that ``load_state_dict`` reads.
    """

    def strip(key: str) -> str:
        return ".".join(part for part in key.split(".") if part not in WRAPPER_COMPONENTS)

    stripped = collections.OrderedDict()
    for key, value in state_dict.items():
        new_key = strip(key)
        if new_key in stripped:
            raise ValueError(f"state_dict keys collide after removing wrapper prefixes: {key!r} -> {new_key!r}")
        stripped[new_key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        stripped._metadata = collections.OrderedDict((strip(key), value) for key, value in metadata.items())
    return stripped

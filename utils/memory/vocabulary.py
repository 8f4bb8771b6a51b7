"""The words a hand-written memory description (models/<name>/memory.py) is written in, in one module.

A description imports this module and nothing else of utils/ (``.importlinter``'s "models/ know nothing of the
helpers" lets ``models.*.memory`` import it alone): what it builds on (:mod:`utils.memory.shapes`,
:mod:`utils.memory.graphs`) and the few facts of the layers below that it shares with the code it describes (how a
band of rows is cut, how many bytes a dtype takes, the one-line error), so that a change there is seen here. What
its parallelism sends it says as :class:`Traffic` (bytes over a group of ranks): the planner, a layer above, times
it.
"""

from __future__ import annotations

from utils.config import ConfigError
from utils.memory.graphs import LN_STATS_BYTES, Layer, Precision, loss_layer, precision_for
from utils.memory.shapes import (MEASURED_ON_CPU, ActivationGraph, MemoryDescription, Traffic, add_params, conv_params,
                                 field_size_of, lr_input_size)
from utils.parallel.context_parallel import band_rows
from utils.parallel.domain_parallel import band_bounds
from utils.precision import dtype_bytes

__all__ = ["LN_STATS_BYTES", "MEASURED_ON_CPU", "ActivationGraph", "ConfigError", "Layer", "MemoryDescription",
           "Precision", "Traffic", "add_params", "band_bounds", "band_rows", "conv_params", "dtype_bytes",
           "field_size_of", "loss_layer", "lr_input_size", "precision_for"]

"""What a training run measures and shows.

- ``logger.py``: the run logger, :class:`~utils.observe.logger.MetricsLogger`: every record to
  ``metrics.jsonl``, TensorBoard and one console line; JSON helpers and the console formats.
- ``flops.py``: what the device does: model FLOPs of a training step, peak FLOP/s of a device
  (datasheet table or a measured matmul), MFU, and the device's memory peak.
- ``scores.py``: validation scores over a whole validation set and all ranks (RMSE, ACC, L1), the
  latitude weights and the bicubic baseline.
- ``pictures.py``: PNG pictures of validation samples (super-resolution, forecast, 3-D slice).
- ``profiling.py``: Step 0b, where a step's time and memory go: torch.profiler trace, memory timeline and
  snapshot, nsys ranges, throughput breakdown.
"""

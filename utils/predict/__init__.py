"""From a checkpoint to predictions a scientist can use (predict.py, rollout.py): the checkpoint and its model
(``checkpoints``), the inputs (``inputs``), tiles stitched with a blend (``tiles``), the output store
(``store``: netCDF / Zarr, WeatherBench 2's layout, resumable region writes by many ranks)."""

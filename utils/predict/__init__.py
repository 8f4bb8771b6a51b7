"""From a checkpoint to predictions a scientist can use (predict.py, rollout.py), and their scores (evaluate.py): the
checkpoint's model (``model``; reading the checkpoint: utils.checkpoint.reading), the inputs (``inputs``), tiles
stitched with a blend (``tiles``), the output store (``store``: netCDF / Zarr, WeatherBench 2's layout, resumable
region writes by many ranks), the truth and climatology a forecast is judged against (``truth``), WeatherBench
2's scores (``scores``), and ensembles: the members' perturbations (``ensemble``) and their probabilistic scores
(``ensemble_scores``)."""

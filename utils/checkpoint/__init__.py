"""Checkpoints, of every kind, and the safety of a run's files; import each name from the module that defines it.

- ``files.py``: names, atomic writes, failed writes (a full disk as one line), the run folder, the newest complete
  checkpoint and the one a run resumes from (also what predict.py, rollout.py and evaluate.py write with).
- ``state.py``: what every checkpoint holds besides the weights (TrainState, RNG states, the model settings).
- ``contents.py``: every checkpoint's contents, built and restored in this one place (single file and DCP).
- ``single.py``: train.py's and train_ddp.py's one-file checkpoints (``torch.save``).
- ``sharded.py``: train_fsdp.py's, train_mp.py's and train_pp.py's DCP folders, and
  ``python -m utils.checkpoint.sharded export`` (one such folder as a train.py file).
- ``reading.py``: any of them read for predict.py and rollout.py (config, step, weights).
"""

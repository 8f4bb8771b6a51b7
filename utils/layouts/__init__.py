"""The layouts: which the training scripts accept, and whether one trains as one process does. Import from the modules:

* :mod:`utils.layouts.accepted` — every layout the training scripts accept (DDP, FSDP, HSDP, tp/cp on train_mp.py's
  mesh, pipelines), checked by the scripts' own checks; the planner (utils/plan/) ranks them;
* :mod:`utils.layouts.equivalence` — a layout applied as its script applies it, trained against one process, every
  gradient compared: check_layouts.py's harness and the equivalence tests'.

accepted ← equivalence (equivalence imports accepted).
"""

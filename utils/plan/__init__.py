"""plan.py's planner: which layout a config needs on a cluster, predicted and ranked. Import from the modules:

* :mod:`utils.plan.clusters` — the machines (config/clusters/clusters.yaml, a user's file, this machine measured);
* :mod:`utils.plan.comm` — the ring model of the collectives (also benchmarks/scaling.py's);
* :mod:`utils.plan.layouts` — every layout the training scripts accept, checked by their own checks;
* :mod:`utils.plan.speed` — the step of a layout: compute, exposed communication, the bubble;
* :mod:`utils.plan.planner` — memory (utils/memory/estimate.py) and speed per layout, ranked, with its command;
* :mod:`utils.plan.equivalence` — a layout applied as its script applies it, trained against one process, every
  gradient compared (check_layouts.py and the equivalence tests).

clusters, comm ← layouts ← speed ← planner; layouts ← equivalence (each imports only those to its left).
"""

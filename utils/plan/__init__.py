"""plan.py's planner: which layout a config needs on a cluster, predicted and ranked. Import from the modules:

* :mod:`utils.plan.clusters` — the machines (config/clusters/clusters.yaml, a user's file, this machine measured);
* :mod:`utils.plan.comm` — the ring model of the collectives (also benchmarks/scaling.py's);
* :mod:`utils.plan.speed` — the step of a layout: compute, exposed communication, the bubble;
* :mod:`utils.plan.planner` — memory (utils/memory/estimate.py) and speed per layout, ranked, with its command;

The layouts it ranks are utils/layouts/accepted.py's (every layout the scripts accept). clusters, comm ← speed ←
planner (each imports only those to its left).
"""

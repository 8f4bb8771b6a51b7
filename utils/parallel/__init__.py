"""The parallel layer: techniques applied from outside to a plain model, in torchtitan's order

    tensor parallel -> context parallel -> activation checkpointing -> torch.compile -> DDP / FSDP2

- ``distributed.py``: the launcher's environment -> ranks, devices, process groups and device meshes.
- ``plans.py``: what is model-specific, read from each model's spec (models/spec.py; the built-in ones in
  models/<name>/spec.py): TP plan, what cp splits, pipeline cuts, AC/FSDP units.
- ``techniques.py``: activation checkpointing, torch.compile and DDP.
- ``fsdp.py``: FSDP2 / HSDP (their DCP checkpoints: utils/checkpoint/sharded.py).
- ``tensor_parallel.py``, ``context_parallel.py`` (the ViT's token bands), ``domain_parallel.py`` (SwinIR's
  field bands with halos), ``pipeline_parallel.py`` (stages and schedules).
"""

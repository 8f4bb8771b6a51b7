"""Shared helpers: config, data, distributed set-up, metrics, checkpoints and scaling techniques.

Models know nothing about parallelism; the functions here build objects and apply techniques
to a plain model (activation checkpointing -> compile -> DDP/FSDP)."""

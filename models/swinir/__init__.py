"""Part I's model, SwinIR (``network.py``), and its spec (``spec.py``: registered when this folder is imported)."""

from .network import SwinIR, build
from .spec import SPEC

__all__ = ["SPEC", "SwinIR", "build"]

"""Part II's model, the ViT forecaster (``network.py``), and its spec (``spec.py``: registered on import)."""

from .network import ViT, build
from .spec import SPEC

__all__ = ["SPEC", "ViT", "build"]

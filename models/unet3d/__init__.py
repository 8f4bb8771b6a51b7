"""Part III's model, SC22's 3-D U-Net (``network.py``), and its spec (``spec.py``: registered on import)."""

from .network import UNet3D
from .spec import SPEC

__all__ = ["SPEC", "UNet3D"]

"""Flow-transformer backbones (Flux, SD3, Wan) behind one ``(x, sigma, cond) -> velocity`` call."""

from .backbone import FAMILIES, Backbone, build
from .conditioning import Conditioning
from .factory import REAL_MODELS, load_config, real, tiny

__all__ = [
    "FAMILIES",
    "REAL_MODELS",
    "Backbone",
    "Conditioning",
    "build",
    "load_config",
    "real",
    "tiny",
]

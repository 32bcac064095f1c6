"""Flow-transformer backbones (Flux, SD3, Wan) behind one ``(x, sigma, cond) -> velocity`` call."""

from .backbone import Backbone, build
from .conditioning import Conditioning
from .factory import REAL_MODELS, load_config, real, tiny
from .families import FAMILIES, Family

__all__ = [
    "FAMILIES",
    "REAL_MODELS",
    "Backbone",
    "Conditioning",
    "Family",
    "build",
    "load_config",
    "real",
    "tiny",
]

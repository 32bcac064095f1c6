"""leancompile: removes the redundant backbone forward of GRPO post-training for flow transformers.

``import leancompile`` loads torch and the library's own modules only: diffusers, peft, transformers,
scikit-learn and matplotlib are imported by the features that use them (a diffusers backbone, LoRA, the demo).
"""
from .api import optimize
from .runtime import optimizer_steps  # noqa: F401  (registers the hook)
from .plan import Plan, StepAction
from .wrapping import NothingServedError, NothingServedWarning, Wrapped, unwrap, wrap

__version__ = "0.1.0"

__all__ = ["NothingServedError", "NothingServedWarning", "Plan", "StepAction", "Wrapped", "__version__", "optimize",
           "unwrap", "wrap"]

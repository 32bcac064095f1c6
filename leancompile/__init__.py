"""leancompile: removes the redundant backbone forward of GRPO post-training for flow transformers."""
from .api import optimize
from .runtime import optimizer_steps  # noqa: F401  (registers the hook)
from .plan import Plan, StepAction
from .wrap import Wrapped, wrap

__all__ = ["Plan", "StepAction", "Wrapped", "optimize", "wrap"]

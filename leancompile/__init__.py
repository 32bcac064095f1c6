"""leancompile: removes the redundant backbone forward of GRPO post-training for flow transformers."""
from .api import optimize
from .runtime import optimizer_steps  # noqa: F401  (registers the hook)
from .plan import Plan, StepAction
from .wrap import NothingServedError, NothingServedWarning, Wrapped, unwrap, wrap

__all__ = ["NothingServedError", "NothingServedWarning", "Plan", "StepAction", "Wrapped", "optimize", "unwrap", "wrap"]

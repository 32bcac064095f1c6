"""leancompile: removes the redundant backbone forward of GRPO post-training for flow transformers."""
from .api import optimize
from .plan import Plan, StepAction

__all__ = ["Plan", "StepAction", "optimize"]

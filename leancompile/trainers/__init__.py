"""Native FlowGRPO and DanceGRPO trainers: the reference every optimization is measured against."""
from .config import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig
from .grpo import DanceGRPOTrainer, FlowGRPOTrainer, GRPOTrainer, MicroStep, Rollout

__all__ = [
    "DanceGRPOConfig",
    "DanceGRPOTrainer",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "MicroStep",
    "Rollout",
]

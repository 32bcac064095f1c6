"""Native FlowGRPO and DanceGRPO trainers: the reference every optimization is measured against."""
from ..protocol import MicroStep, Rollout
from .config import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig
from .grpo import DanceGRPOTrainer, FlowGRPOTrainer, GRPOTrainer

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

"""Native FlowGRPO and DanceGRPO trainers: the reference every optimization is measured against."""
from ..protocol import MicroStep, Rollout
from .config import DanceGRPOConfig, FlowGRPOConfig, GRPOConfig
from .grpo import TRAINERS, DanceGRPOTrainer, FlowGRPOTrainer, GRPOTrainer, trainer_class

__all__ = [
    "DanceGRPOConfig",
    "DanceGRPOTrainer",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "MicroStep",
    "Rollout",
    "TRAINERS",
    "trainer_class",
]

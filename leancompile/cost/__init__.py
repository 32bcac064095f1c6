"""The cost model: devices, profiles of backbone calls on fake tensors, memory and time, and the planner."""
from .devices import DEVICES, Device, get_device, live_device
from .planner import CostPlan, Estimate, Scenario, plan
from .profile import CallProfile, profile_call
from .scenario import model_scenario, trainer_scenario

__all__ = ["DEVICES", "CallProfile", "CostPlan", "Device", "Estimate", "Scenario", "get_device", "live_device",
           "model_scenario", "plan", "profile_call", "trainer_scenario"]

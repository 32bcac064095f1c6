"""The cost model: devices, profiles of backbone calls on fake tensors, memory and time, and the planner."""

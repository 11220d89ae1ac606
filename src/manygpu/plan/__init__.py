"""The planner: per-device memory and step time of each strategy, and a recommendation."""

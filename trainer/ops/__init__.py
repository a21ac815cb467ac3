"""Tools over a run's outputs, without torch: ``calibrate`` (the planner's cost model
fitted to the recorded micro-batch timings) and ``plot`` (PNG curves)."""

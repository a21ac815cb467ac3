"""The planning room: pure functions from sample lengths and a batch spec to an epoch plan
(spec, cost model, buckets, packing, schedule, planner) and the plan-quality measures."""

"""`rlcore plan`: per-rank memory of every role of a run at each layout, simulated before any
device is booked (the meta device, torch's fake process group, fake tensors), and the smallest
layouts that fit. See `planner` for the search, `simulate` for one simulated step, `rollout` for
the rollout's arithmetic, `torch_api` for the private torch APIs it stands on."""

from rlcore.plan.hardware import Hardware, PlanInputError, parse_fraction, parse_size
from rlcore.plan.planner import PlanReport, plan_run
from rlcore.plan.report import render

__all__ = ["Hardware", "PlanInputError", "PlanReport", "parse_fraction", "parse_size", "plan_run", "render"]

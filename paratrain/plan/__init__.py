"""The plan IR shared by the runtime, the cost model and the tests (see :mod:`paratrain.plan.ir`)."""

from paratrain.plan.cost import Costs, alpha_beta_time, simulate
from paratrain.plan.ir import Action, Message, Plan, PlanBuilder, PlanError, Received, Slice

__all__ = [
    "Action",
    "Costs",
    "Message",
    "Plan",
    "PlanBuilder",
    "PlanError",
    "Received",
    "Slice",
    "alpha_beta_time",
    "simulate",
]

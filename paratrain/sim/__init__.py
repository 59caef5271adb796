"""Prediction before running: machine profiles, a discrete-event simulator over paratrain's own plans, a planner."""

from paratrain.sim.machine import Cluster, LayerCost, LinkCost, MachineProfile, ModelProfile

__all__ = ["Cluster", "LayerCost", "LinkCost", "MachineProfile", "ModelProfile"]

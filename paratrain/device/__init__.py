"""Tensors that live on an accelerator (CUDA): how their bytes reach the host and the results come back.

Imports nothing heavy: torch is imported by :mod:`.staging` only when a device tensor is already in hand, so the
communication core still starts without torch.
"""

from __future__ import annotations

from paratrain.device.events import DEVICE_TIMEOUT, wait_event
from paratrain.device.staging import copy_to_device_, host_view, on_device, to_device, to_host

__all__ = ["DEVICE_TIMEOUT", "copy_to_device_", "host_view", "on_device", "to_device", "to_host", "wait_event"]

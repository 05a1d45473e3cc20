"""Devices that answer probes, behind one interface (:class:`Device`).

- ``local``: real ranks on this node (the launcher, the worker, the engines: the only place
  torch, transformers and DeepSpeed load, in the ranks' own processes).
- ``simulated``: the estimator as a GPU, with seeded model error and timing noise.
"""

from __future__ import annotations

from autotune.devices.base import Clock, Device, ProbeClock, WallClock
from autotune.devices.local import LocalDevice
from autotune.devices.simulated import SimulatedDevice

__all__ = ["Clock", "Device", "LocalDevice", "ProbeClock", "SimulatedDevice", "WallClock"]

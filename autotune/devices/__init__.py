"""Devices that answer probes, behind one interface (:class:`Device`).

- ``local``: real ranks on this node (the launcher, the worker, the engines: the only place
  torch, transformers and DeepSpeed load, in the ranks' own processes).
- ``simulated``: the estimator as a GPU, with seeded error terms and timing noise.
- ``replay``: a grid of probes recorded on a real GPU, answered as measured (nothing guessed).
"""

from __future__ import annotations

from autotune.devices.base import Clock, Device, ProbeClock, WallClock
from autotune.devices.local import LocalDevice
from autotune.devices.replay import Grid, ReplayDevice
from autotune.devices.simulated import ErrorTerm, SimulatedDevice

__all__ = [
    "Clock",
    "Device",
    "ErrorTerm",
    "Grid",
    "LocalDevice",
    "ProbeClock",
    "ReplayDevice",
    "SimulatedDevice",
    "WallClock",
]

"""Model shapes the tuner can train: presets and Hugging Face ``config.json`` files.

Torch-free: the probes build the real model on the torch side
(:func:`autotune.probe.modeling.hf_config`).
"""

from __future__ import annotations

from autotune.models.presets import preset_names, resolve_model
from autotune.models.spec import ModelSpec

__all__ = ["ModelSpec", "preset_names", "resolve_model"]

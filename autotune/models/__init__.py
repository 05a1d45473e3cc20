"""Model shapes the tuner can train: presets and Hugging Face ``config.json`` files."""

from __future__ import annotations

from autotune.models.presets import ModelSpec, preset_names, resolve_model, synthetic_batch

__all__ = ["ModelSpec", "preset_names", "resolve_model", "synthetic_batch"]

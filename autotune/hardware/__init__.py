"""What accelerators this node has, how fast GPUs are, and how much host memory is left.

- ``specs``: ``GpuSpec``, one GPU model's memory, peak FLOP/s and bandwidths.
- ``catalogue``: the vendor figures for every GPU the estimator knows, with their sources, and
  the stand-in spec of the CPU under an emulated device memory cap.
- ``lookup``: a catalogue entry from a key, alias, driver name or GPU file.
- ``gpufile``: GPUs the catalogue lacks, described in a TOML file (see docs/gpus.md).
- ``detect``: the GPUs visible here (NVML, never ``torch.cuda``) and host memory.
"""

from __future__ import annotations

from autotune.hardware.catalogue import cpu_device_spec
from autotune.hardware.detect import (
    GpuInfo,
    detect_gpus,
    host_available_bytes,
    host_memory_bytes,
)
from autotune.hardware.gpufile import load_gpu_file
from autotune.hardware.lookup import (
    catalogue_markdown,
    gpu_keys,
    gpu_spec,
    lookup_gpu,
    peak_flops_for,
)
from autotune.hardware.specs import FormFactor, GpuSpec

__all__ = [
    "FormFactor",
    "GpuInfo",
    "GpuSpec",
    "catalogue_markdown",
    "cpu_device_spec",
    "detect_gpus",
    "gpu_keys",
    "gpu_spec",
    "host_available_bytes",
    "host_memory_bytes",
    "load_gpu_file",
    "lookup_gpu",
    "peak_flops_for",
]

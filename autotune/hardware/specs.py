"""The description of one GPU model: memory, peak FLOP/s per dtype, bandwidths."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from autotune.units import MIB

FormFactor = Literal["sxm", "pcie"]
"""``sxm``: a module on a baseboard whose GPUs talk over a GPU fabric (NVIDIA SXM, and AMD's OAM,
which plays the same role); ``pcie``: an add-in card, whose GPU-to-GPU traffic crosses PCIe."""

FORM_FACTORS: dict[str, FormFactor] = {"sxm": "sxm", "pcie": "pcie"}
"""The form factors by their spelling in a GPU file."""

DTYPES = ("bf16", "fp16", "tf32", "fp32")
"""The dtypes a GPU's peak FLOP/s are given for, in the catalogue's column order."""

_DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def canonical_dtype(dtype: str) -> str | None:
    """``bf16``/``fp16``/``tf32``/``fp32`` for a dtype spelling (``torch.`` prefix ignored)."""
    return _DTYPE_ALIASES.get(dtype.lower().removeprefix("torch."))


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """One GPU model: what the estimator needs to predict memory and step time without it.

    Bandwidths are bytes per second in one direction (datasheets print NVLink and PCIe as the
    sum of both directions; those figures are halved here).  ``dataclasses.replace`` overrides
    a field, e.g. ``inter_node_bandwidth`` for a cluster with another network.
    """

    key: str
    """Catalogue key, lower case: ``h100-80gb``, ``a100-40gb-pcie``, ``rtx4090``, ..."""
    name: str
    """Marketing name, e.g. ``NVIDIA H100 SXM5 80GB``."""
    memory_bytes: int
    """Device memory as the driver reports it (``nvidia-smi``'s total), not the datasheet's
    nominal figure: the H100 80GB shows 81559 MiB.  CUDA's context takes a little of it."""
    peak_flops: dict[str, float]
    """Dense (no 2:4 sparsity) peak FLOP/s by dtype (``bf16``, ``fp16``, ``tf32``, ``fp32``):
    tensor-core rates, fp32 the non-tensor rate; a dtype without a fast path is absent (V100 has
    no bf16 or tf32).  Shared with the catalogue: copy before changing."""
    hbm_bandwidth: float
    """Device memory bandwidth (HBM, or GDDR on the workstation cards), bytes/s."""
    intra_node_bandwidth: float
    """GPU-to-GPU bandwidth inside a node per GPU, one direction, bytes/s: NVLink (or AMD
    Infinity Fabric) on ``sxm`` parts, the PCIe link on cards."""
    host_link_bandwidth: float
    """Effective GPU-to-host bandwidth, one direction, bytes/s (PCIe; NVLink-C2C on GH200):
    what CPU offload of optimizer states and parameters pays."""
    inter_node_bandwidth: float
    """Network bandwidth per GPU, one direction, bytes/s.  A typical cluster for the model, not
    a property of the GPU: override it for the cluster at hand."""
    form_factor: FormFactor
    """``sxm`` (module with a GPU fabric) or ``pcie`` (add-in card)."""

    def peak(self, dtype: str) -> float | None:
        """Dense peak FLOP/s for a dtype spelling (``bfloat16``, ``torch.float16``, ``fp32``...).

        Returns:
            FLOP/s, or None when the GPU has no fast path for the dtype (bf16 on V100).
        """
        canonical = canonical_dtype(dtype)
        return None if canonical is None else self.peak_flops.get(canonical)

    def to_toml(self) -> str:
        """This spec as a GPU file for ``load_gpu_file``: a start for describing a similar GPU.

        Returns:
            TOML text; loading it gives back an equal ``GpuSpec``.
        """
        lines = [
            f"key = {json.dumps(self.key)}",
            f"name = {json.dumps(self.name)}",
            f"memory = {_size_value(self.memory_bytes)}",
            f"hbm_bandwidth = {_rate_value(self.hbm_bandwidth, 1e9, 'GB/s')}",
            f"intra_node_bandwidth = {_rate_value(self.intra_node_bandwidth, 1e9, 'GB/s')}",
            f"host_link_bandwidth = {_rate_value(self.host_link_bandwidth, 1e9, 'GB/s')}",
            f"inter_node_bandwidth = {_rate_value(self.inter_node_bandwidth, 1e9, 'GB/s')}",
            f"form_factor = {json.dumps(self.form_factor)}",
            "",
            "[peak_flops]",
            *(
                f"{dtype} = {_rate_value(self.peak_flops[dtype], 1e12, 'TFLOPS')}"
                for dtype in DTYPES
                if dtype in self.peak_flops
            ),
        ]
        return "\n".join(lines) + "\n"


def _size_value(size: int) -> str:
    """A byte count as TOML: ``"81559MiB"`` when whole MiB (as nvidia-smi prints), else bytes."""
    return json.dumps(f"{size // MIB}MiB") if size % MIB == 0 else str(size)


def _rate_value(value: float, scale: float, unit: str) -> str:
    """A rate as TOML: ``"3350GB/s"`` when that reads back exactly, else the plain number."""
    text = f"{value / scale:g}"
    if "e" not in text and float(text) * scale == value:
        return json.dumps(f"{text}{unit}")
    return repr(float(value))

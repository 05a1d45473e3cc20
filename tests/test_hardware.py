"""Tests for autotune.hardware: GPU catalogue, NVML detection and host memory."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest

from autotune import hardware
from autotune.hardware import (
    GpuInfo,
    detect_gpus,
    host_available_bytes,
    host_memory_bytes,
    lookup_gpu,
    peak_flops_for,
)

GIB = 1024**3


@pytest.mark.parametrize(
    ("driver_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIE"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("Tesla V100-SXM2-32GB", "V100-SXM"),
        ("Tesla V100-SXM2-16GB", "V100-SXM"),
        ("Tesla V100-PCIE-16GB", "V100-PCIE"),
        ("Tesla V100S-PCIE-32GB", "V100S-PCIE"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("AMD Instinct MI300X", "MI300X"),
        ("nvidia h100 pcie", "H100-PCIE"),  # case does not matter
    ],
)
def test_lookup_gpu_maps_driver_names(driver_name: str, key: str) -> None:
    assert lookup_gpu(driver_name) == key


@pytest.mark.parametrize(
    "driver_name",
    [
        "NVIDIA RTX 6000 Ada Generation",  # not an A6000
        "NVIDIA GeForce RTX 3090 Ti",  # faster than the 3090
        "NVIDIA GeForce RTX 4090 D",  # fewer SMs than the 4090
        "NVIDIA A40",
        "Tesla T4",
        "",
    ],
)
def test_lookup_gpu_unknown(driver_name: str) -> None:
    assert lookup_gpu(driver_name) is None


def test_a100_size_from_memory_when_name_lacks_it() -> None:
    assert lookup_gpu("NVIDIA A100-SXM4", memory_bytes=80 * GIB) == "A100-80GB"
    assert lookup_gpu("NVIDIA A100-SXM4", memory_bytes=40 * GIB) == "A100-40GB"


def test_peak_flops_values() -> None:
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989e12, rel=0.001)
    assert peak_flops_for("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12, rel=0.001)
    assert peak_flops_for("NVIDIA H100 NVL", "bf16") == pytest.approx(835e12, rel=0.001)
    assert peak_flops_for("NVIDIA H200", "torch.bfloat16") == pytest.approx(989e12, rel=0.001)
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops_for("NVIDIA A100-PCIE-40GB", "tf32") == 156e12
    assert peak_flops_for("NVIDIA A100-PCIE-40GB", "fp32") == 19.5e12
    assert peak_flops_for("NVIDIA GeForce RTX 4090", "fp16") == pytest.approx(165.2e12)
    assert peak_flops_for("NVIDIA L4", "bf16") == 121e12
    assert peak_flops_for("NVIDIA A10G", "bf16") == 125e12
    assert peak_flops_for("H100-PCIE", "fp16") == peak_flops_for("NVIDIA H100 PCIe", "fp16")


def test_v100_has_no_bf16() -> None:
    assert peak_flops_for("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_flops_for("Tesla V100-SXM2-32GB", "tf32") is None
    assert peak_flops_for("Tesla V100-SXM2-32GB", "fp16") == 125e12


def test_peak_flops_unknown_gpu_or_dtype() -> None:
    assert peak_flops_for("Tesla T4", "fp16") is None
    assert peak_flops_for("NVIDIA H100 PCIe", "int8") is None


def test_catalogue_is_dense_and_consistent() -> None:
    for key, entry in hardware._CATALOGUE.items():
        flops = entry.peak_flops
        assert flops["fp32"] < flops["fp16"], key
        if "bf16" in flops:
            assert flops["bf16"] == flops["fp16"], key
            # Dense TF32 tensor throughput is half of BF16 on every listed generation; a row
            # copied from a sparsity column would break this.
            assert flops["tf32"] == pytest.approx(flops["bf16"] / 2, rel=0.02), key
        assert flops["fp16"] < 1.4e15, key  # above this is a 2:4-sparsity figure


def test_detect_gpus_returns_none_here_without_raising() -> None:
    assert detect_gpus() is None


def test_detect_gpus_does_not_import_torch() -> None:
    code = (
        "import sys; from autotune.hardware import detect_gpus; detect_gpus(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(
    *, count: int = 8, name: object = b"NVIDIA H100 80GB HBM3", fail_init: bool = False
) -> types.SimpleNamespace:
    calls: list[str] = []

    def init() -> None:
        if fail_init:
            raise _FakeNVMLError("NVML Shared Library Not Found")
        calls.append("init")

    def by_uuid(uuid: str) -> str:
        if not uuid.startswith("GPU-"):
            raise _FakeNVMLError("Not Found")
        return uuid

    return types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda index: calls.append(f"index {index}") or index,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetName=lambda handle: name,
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(total=85520809984),
        calls=calls,
    )


def test_detect_gpus_with_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = detect_gpus()
    assert info == GpuInfo(
        name="NVIDIA H100 80GB HBM3",
        memory_bytes=85520809984,
        count=8,
        peak_flops=hardware._CATALOGUE["H100-SXM"].peak_flops,
        catalogue_key="H100-SXM",
    )
    assert fake.calls == ["init", "index 0", "shutdown"]


@pytest.mark.parametrize(
    ("visible", "count", "first"),
    [
        ("2,3", 2, "index 2"),
        ("0,1,-1,3", 2, "index 0"),
        ("5,9,1", 1, "index 5"),
        ("GPU-ab", 1, None),
    ],
)
def test_detect_gpus_honours_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, count: int, first: str | None
) -> None:
    fake = _fake_pynvml(name="NVIDIA A100-SXM4-80GB")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    info = detect_gpus()
    assert info is not None and info.count == count
    assert info.catalogue_key == "A100-80GB"
    if first is not None:
        assert first in fake.calls


@pytest.mark.parametrize("visible", ["", "-1", "NoDevFiles", "12", "9,0"])
def test_detect_gpus_none_when_nothing_visible(
    monkeypatch: pytest.MonkeyPatch, visible: str
) -> None:
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert detect_gpus() is None
    assert fake.calls[-1] == "shutdown"


def test_detect_gpus_none_on_nvml_failure_or_missing_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert detect_gpus() is None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(count=0))
    assert detect_gpus() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert detect_gpus() is None


def test_unknown_gpu_has_empty_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(count=1, name="Tesla T4"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = detect_gpus()
    assert info is not None
    assert (info.name, info.catalogue_key, info.peak_flops) == ("Tesla T4", None, {})


def test_host_memory_without_cgroup_limit(tmp_path: Path) -> None:
    total = psutil.virtual_memory().total
    assert host_memory_bytes(cgroup_root=tmp_path, cgroup="/") == total
    assert 0 < host_available_bytes(cgroup_root=tmp_path, cgroup="/") <= total
    assert 0 < host_available_bytes() <= host_memory_bytes() <= total


def test_host_memory_capped_by_cgroup_v2_ancestor(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text(f"{GIB}\n")
    job = tmp_path / "slurm" / "job_1"
    job.mkdir(parents=True)
    (tmp_path / "slurm" / "memory.max").write_text(f"{4 * GIB}\n")
    (tmp_path / "slurm" / "memory.current").write_text(f"{3 * GIB}\n")
    (tmp_path / "slurm" / "memory.stat").write_text(f"anon 123\ninactive_file {GIB}\n")
    (job / "memory.max").write_text("max\n")
    (job / "memory.current").write_text("0\n")
    limit = min(4 * GIB, psutil.virtual_memory().total)
    assert host_memory_bytes(cgroup_root=tmp_path, cgroup="/slurm/job_1") == limit
    # 4 GiB limit, 3 GiB used of which 1 GiB is reclaimable page cache: 2 GiB headroom.
    available = host_available_bytes(cgroup_root=tmp_path, cgroup="/slurm/job_1")
    assert available == min(2 * GIB, psutil.virtual_memory().available)


def test_host_memory_cgroup_v1_unlimited(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert host_memory_bytes(cgroup_root=tmp_path, cgroup="/") == psutil.virtual_memory().total

"""Tests for autotune.hardware: GPU catalogue, NVML detection and host memory."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest

from autotune.hardware import (
    GpuInfo,
    GpuSpec,
    catalogue_markdown,
    cpu_device_spec,
    detect_gpus,
    gpu_keys,
    gpu_spec,
    host_available_bytes,
    host_memory_bytes,
    load_gpu_file,
    lookup_gpu,
    peak_flops_for,
)

GIB = 1024**3
MIB = 1024**2


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
        ("AMD Instinct MI325X", "MI325X"),
        ("AMD Instinct MI355X", "MI355X"),
        ("NVIDIA B200", "B200"),  # as nvidia-smi prints them
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA B300 SXM6 AC", "B300"),
        ("nvidia h100 pcie", "H100-PCIE"),  # case does not matter
    ],
)
def test_lookup_gpu_maps_driver_names(driver_name: str, key: str) -> None:
    assert lookup_gpu(driver_name) == key
    # Family keys stay usable with the spec catalogue; variants within a family share peaks.
    assert gpu_spec(key).peak_flops == gpu_spec(driver_name).peak_flops


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


BLACKWELL_CLASS = {"b200", "gb200", "b300", "mi355x"}
"""The parts whose dense fp16 peak is above 1.4 PFLOP/s (NVIDIA Blackwell, AMD CDNA 4)."""


def test_catalogue_is_dense_and_consistent() -> None:
    for key in gpu_keys():
        flops = gpu_spec(key).peak_flops
        assert flops["fp32"] < flops["fp16"], key
        if "bf16" in flops:
            assert flops["bf16"] == flops["fp16"], key
        if "bf16" in flops and "tf32" in flops:
            # Dense TF32 tensor throughput is half of BF16 on every listed generation; a row
            # copied from a sparsity column would break this.
            assert flops["tf32"] == pytest.approx(flops["bf16"] / 2, rel=0.02), key
        # Above these is a 2:4-sparsity figure: Hopper's and CDNA 3's densest is 1.31 PFLOP/s,
        # Blackwell's 2.5 (its sparse figures are 4.5 to 5).
        limit = 2.6e15 if key in BLACKWELL_CLASS else 1.4e15
        assert flops["fp16"] < limit, key
    assert "tf32" not in gpu_spec("mi355x").peak_flops  # CDNA 4: no TF32 matrix path


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

    def by_index(index: int) -> int:
        calls.append(f"index {index}")
        return index

    return types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetName=lambda handle: name,
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(total=85520809984),
        nvmlSystemGetDriverVersion=lambda: "580.159.04",  # the H100 node's (measurements)
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
        peak_flops=gpu_spec("h100-80gb").peak_flops,
        catalogue_key="H100-SXM",
        driver="580.159.04",
    )
    assert info is not None and info.spec is gpu_spec("h100-80gb")
    # The catalogue holds the driver reading, so the detected size matches it exactly.
    assert info.spec.memory_bytes == info.memory_bytes
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
    assert info.spec is None


def test_every_key_resolves_to_itself() -> None:
    keys = gpu_keys()
    assert len(keys) == len(set(keys)) >= 20
    for key in keys:
        assert key == key.lower()
        assert gpu_spec(key).key == key
        assert gpu_spec(key.upper()) is gpu_spec(key)


@pytest.mark.parametrize(
    ("alias", "key"),
    [
        ("h100", "h100-80gb"),
        ("H100", "h100-80gb"),
        ("H100-SXM", "h100-80gb"),
        ("a100", "a100-80gb"),
        ("4090", "rtx4090"),
        ("RTX-4090", "rtx4090"),
        ("3090", "rtx3090"),
        ("RTX-A6000", "a6000"),
        (" v100 ", "v100-32gb"),
        ("V100S-PCIE", "v100s"),
    ],
)
def test_gpu_spec_aliases(alias: str, key: str) -> None:
    assert gpu_spec(alias).key == key


@pytest.mark.parametrize(
    ("driver_name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-PCIE-16GB", "v100-16gb-pcie"),
        ("Tesla V100S-PCIE-32GB", "v100s"),
        ("AMD Instinct MI300X", "mi300x"),
    ],
)
def test_gpu_spec_from_driver_names(driver_name: str, key: str) -> None:
    assert gpu_spec(driver_name).key == key


def test_detected_gpu_spec_uses_memory_for_the_variant() -> None:
    def info(name: str, mib: int) -> GpuInfo:
        return GpuInfo(name=name, memory_bytes=mib * MIB, count=1)

    assert info("Tesla V100-SXM2", 16384).spec is gpu_spec("v100-16gb")
    assert info("Tesla V100-SXM2", 32768).spec is gpu_spec("v100-32gb")
    assert info("NVIDIA A100-PCIE", 81920).spec is gpu_spec("a100-80gb-pcie")
    assert info("NVIDIA H200", 143771).spec is gpu_spec("h200")
    assert info("Tesla T4", 15360).spec is None


@pytest.mark.parametrize(
    # A key-shaped name must be a key: the driver-name rules would read "h100-94gb" as an H100.
    "name",
    ["Tesla T4", "NVIDIA RTX 6000 Ada Generation", "", "h100-94gb", "NVIDIA-H100"],
)
def test_unknown_gpu_error_lists_keys_and_the_file_route(name: str) -> None:
    with pytest.raises(ValueError, match="unknown GPU") as caught:
        gpu_spec(name)
    message = str(caught.value)
    assert "\n" not in message
    assert all(key in message for key in gpu_keys())
    assert ".toml" in message and "docs/gpus.md" in message


def test_peaks_by_dtype_spelling() -> None:
    assert gpu_spec("h100").peak("torch.bfloat16") == pytest.approx(989.4e12)
    assert gpu_spec("v100").peak("bfloat16") is None
    assert gpu_spec("v100").peak("int8") is None
    assert peak_flops_for("a100-40gb-pcie", "tf32") == 156e12
    assert peak_flops_for("4090", "fp16") == pytest.approx(165.2e12)


def test_catalogue_values_are_sane() -> None:
    specs = [gpu_spec(key) for key in gpu_keys()]
    assert gpu_spec("h200").memory_bytes > gpu_spec("h100").memory_bytes
    newest = [gpu_spec(k).memory_bytes for k in ("mi355x", "b300", "mi325x", "gb200", "b200")]
    assert newest == sorted(newest, reverse=True) and newest[-1] > gpu_spec("h200").memory_bytes
    # NVLink 5 doubles NVLink 4 (1.8 against 0.9 TB/s both directions).
    assert gpu_spec("b200").intra_node_bandwidth == 2 * gpu_spec("h100").intra_node_bandwidth
    assert gpu_spec("h100").memory_bytes == 81559 * MIB  # nvidia-smi's reading
    assert gpu_spec("a100").memory_bytes == 81920 * MIB
    bandwidths = [gpu_spec(k).hbm_bandwidth for k in ("h200", "h100", "a100", "a100-40gb")]
    assert bandwidths == sorted(bandwidths, reverse=True)
    slowest_sxm = min(s.intra_node_bandwidth for s in specs if s.form_factor == "sxm")
    fastest_pcie = max(s.intra_node_bandwidth for s in specs if s.form_factor == "pcie")
    assert slowest_sxm > 2 * fastest_pcie
    for spec in specs:
        flops = spec.peak_flops
        assert max(flops.get("bf16", 0.0), flops["fp16"]) > flops["fp32"], spec.key
        # HBM3E tops out at 8 TB/s (B200/GB200/MI355X), networks at 800 Gb/s a GPU (B300's
        # ConnectX-8), memory at 288 GiB (MI355X).
        assert 200e9 <= spec.hbm_bandwidth <= 8e12, spec.key
        assert spec.host_link_bandwidth <= spec.intra_node_bandwidth, spec.key
        assert 10e9 <= spec.inter_node_bandwidth <= 100e9, spec.key
        assert spec.form_factor in ("sxm", "pcie"), spec.key
        assert 16 * GIB <= spec.memory_bytes <= 288 * GIB, spec.key
        # A size in the key ("a100-40gb") is the datasheet's: the driver reading lies between
        # 95 % of it in GB and the same number in GiB.
        for size in re.findall(r"(\d+)gb", spec.key):
            assert 0.95 * int(size) * 1e9 <= spec.memory_bytes <= int(size) * GIB, spec.key


def test_cpu_device_spec_stands_for_the_cpu_under_a_cap(tmp_path: Path) -> None:
    spec = cpu_device_spec(3 * GIB)
    assert (spec.key, spec.name) == ("cpu", "CPU (emulated device memory)")
    assert spec.memory_bytes == 3 * GIB  # the emulated cap, nothing taken off
    assert spec.peak_flops == {"bf16": 1e11, "fp16": 1e11, "fp32": 1e11}
    assert spec.peak("torch.bfloat16") == 1e11
    assert spec.peak("tf32") is None
    rates = (
        spec.hbm_bandwidth,
        spec.intra_node_bandwidth,
        spec.host_link_bandwidth,
        spec.inter_node_bandwidth,
    )
    assert rates == (20e9, 5e9, 20e9, 1e9)
    assert spec.form_factor == "pcie"
    assert cpu_device_spec(GIB).memory_bytes == GIB
    assert "cpu" not in gpu_keys()  # a stand-in, not a catalogue entry
    path = tmp_path / "cpu.toml"
    path.write_text(spec.to_toml())
    assert load_gpu_file(path) == spec


_UNLISTED = """\
name = "NVIDIA RTX 6000 Ada Generation"
memory = "48GiB"
hbm_bandwidth = "960GB/s"
intra_node_bandwidth = "25 GB/s"
host_link_bandwidth = 25e9
inter_node_bandwidth = "400Gb/s"
form_factor = "PCIe"

[peak_flops]
bf16 = "364.2 TFLOPS"
fp16 = "364.2TFLOP/s"
tf32 = 182.1e12
fp32 = "91.1TFLOPS"
"""


def test_gpu_file_with_units(tmp_path: Path) -> None:
    path = tmp_path / "RTX6000-Ada.toml"
    path.write_text(_UNLISTED)
    spec = load_gpu_file(path)
    assert spec.key == "rtx6000-ada"  # from the file name
    assert spec.name == "NVIDIA RTX 6000 Ada Generation"
    assert spec.memory_bytes == 48 * GIB
    assert spec.hbm_bandwidth == 960e9
    assert spec.intra_node_bandwidth == spec.host_link_bandwidth == 25e9
    assert spec.inter_node_bandwidth == 50e9  # 400 Gb/s: bits
    assert spec.form_factor == "pcie"
    expected = {"bf16": 364.2e12, "fp16": 364.2e12, "tf32": 182.1e12, "fp32": 91.1e12}
    assert spec.peak_flops == pytest.approx(expected)
    assert gpu_spec(str(path)) == spec == gpu_spec(path)
    # Written back out and read again, it is the same spec.
    again = tmp_path / "other.toml"
    again.write_text(spec.to_toml())
    assert load_gpu_file(again) == spec


def test_gpu_file_plain_numbers_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "card.toml"
    path.write_text(
        'key = "My-Card"\nname = "card"\nmemory_bytes = 1073741824\nhbm_bandwidth = 1e12\n'
        'intra_node_bandwidth = "1GiB/s"\nhost_link_bandwidth = "100Gbps"\nform_factor = "sxm"\n'
        "[peak_flops]\nfloat16 = 2e14\nfp32 = 1e13\n"
    )
    spec = load_gpu_file(path)
    assert (spec.key, spec.memory_bytes, spec.hbm_bandwidth) == ("my-card", GIB, 1e12)
    assert (spec.intra_node_bandwidth, spec.host_link_bandwidth) == (2.0**30, 12.5e9)
    assert spec.inter_node_bandwidth == 12.5e9  # the 100 Gb/s default
    assert spec.peak_flops == {"fp16": 2e14, "fp32": 1e13}


@pytest.mark.parametrize("key", gpu_keys())
def test_catalogue_entries_round_trip_through_toml(tmp_path: Path, key: str) -> None:
    path = tmp_path / "gpu.toml"
    path.write_text(gpu_spec(key).to_toml())
    assert load_gpu_file(path) == gpu_spec(key)


_FIELDS: dict[str, str] = {
    "name": '"card"',
    "memory": '"48GiB"',
    "hbm_bandwidth": '"960GB/s"',
    "intra_node_bandwidth": '"25GB/s"',
    "host_link_bandwidth": '"25GB/s"',
    "form_factor": '"pcie"',
    "peak_flops": '{ bf16 = "300TFLOPS", fp32 = "90TFLOPS" }',
}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"name": None}, "name"),
        ({"memory": None}, "memory"),
        ({"intra_node_bandwidth": None}, "intra_node_bandwidth"),
        ({"memory": '"48 potatoes"'}, "memory"),
        ({"memory": "-1"}, "memory"),
        ({"memory": "true"}, "memory"),
        ({"memory_bytes": "1024"}, "memory"),  # both spellings at once
        ({"hbm_bandwidth": '"960GB"'}, "hbm_bandwidth"),
        ({"hbm_bandwidth": '"fast"'}, "hbm_bandwidth"),
        ({"hbm_bandwidth": "0"}, "hbm_bandwidth"),
        ({"host_link_bandwidth": "nan"}, "host_link_bandwidth"),
        ({"inter_node_bandwidth": "[1, 2]"}, "inter_node_bandwidth"),
        ({"form_factor": '"oam"'}, "form_factor"),
        ({"name": '""'}, "name"),
        ({"peak_flops": "{}"}, "peak_flops"),
        ({"peak_flops": '{ int8 = "600TFLOPS" }'}, "peak_flops"),
        ({"peak_flops": '{ bf16 = "lots" }'}, "peak_flops"),
        ({"hbm_bandwith": '"960GB/s"'}, "hbm_bandwith"),  # a typo is not ignored
    ],
)
def test_gpu_file_invalid_field_is_named(
    tmp_path: Path, changes: dict[str, str | None], field: str
) -> None:
    fields: dict[str, str | None] = {**_FIELDS, **changes}
    path = tmp_path / "bad.toml"
    path.write_text("".join(f"{k} = {v}\n" for k, v in fields.items() if v is not None))
    with pytest.raises(ValueError, match=f"field '{field}'") as caught:
        load_gpu_file(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_gpu_file_unreadable_or_not_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read GPU file"):
        gpu_spec(str(tmp_path / "missing.toml"))
    path = tmp_path / "broken.toml"
    path.write_text("name = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_gpu_file(path)


_DOCS = Path(__file__).resolve().parent.parent / "docs" / "gpus.md"


def test_docs_table_matches_the_catalogue() -> None:
    assert catalogue_markdown() in _DOCS.read_text(), "regenerate the table in docs/gpus.md"


def test_docs_example_file_loads(tmp_path: Path) -> None:
    blocks = re.findall(r"```toml\n(.*?)```", _DOCS.read_text(), flags=re.DOTALL)
    assert blocks
    for index, block in enumerate(blocks):
        path = tmp_path / f"example{index}.toml"
        path.write_text(block)
        assert isinstance(load_gpu_file(path), GpuSpec)


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

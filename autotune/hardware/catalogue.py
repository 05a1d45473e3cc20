"""The GPU catalogue: vendor figures for every GPU the estimator knows, with sources."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from autotune.hardware.specs import GpuSpec
from autotune.units import MIB


def _flops(bf16: float | None, fp16: float, tf32: float | None, fp32: float) -> dict[str, float]:
    """Build a peak-FLOP/s row from TFLOP/s figures; None marks a dtype with no tensor path."""
    row = {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}
    return {dtype: tflops * 1e12 for dtype, tflops in row.items() if tflops is not None}


# Link rates, bytes/s in one direction.
#   PCIe x16 raw per direction: Gen3 15.75, Gen4 31.5, Gen5 63 GB/s (PCI-SIG base specs; the
#   datasheets' "PCIe Gen5 128 GB/s" is both directions).  Pinned-memory copies reach about
#   80 % of raw (NVIDIA's cuda-samples bandwidthTest reports ~12, ~25, ~50 GB/s), so those
#   effective figures are used: they are what offload and cross-card traffic actually get.
_PCIE3 = 12e9
_PCIE4 = 25e9
_PCIE5 = 50e9
#   PCIe Gen6 x16: "PCIe Gen6: 256 GB/s" (Blackwell Ultra datasheet, HGX B300; both directions),
#   128 GB/s raw a direction; 80 % of it as for the earlier generations.
_PCIE6 = 100e9
#   NVLink per GPU, all links together, one direction: V100 SXM2 NVLink 2 "300 GB/s", A100 SXM
#   NVLink 3 "600 GB/s", H100/H200 SXM NVLink 4 "900 GB/s" (datasheets, both directions).
_NVLINK2 = 150e9
_NVLINK3 = 300e9
_NVLINK4 = 450e9
#   Blackwell (B200, GB200, B300) NVLink 5: "1.8 TB/s" per GPU (HGX and GB200 NVL72 pages, the
#   Blackwell datasheets; both directions; nvidia-smi shows 18 links of 53.125 GB/s on a B300).
_NVLINK5 = 900e9
#   GH200: NVLink-C2C to the Grace CPU, "900 GB/s" both directions (GH200 datasheet).
_NVLINK_C2C = 450e9
#   GB200: one NVLink-C2C of "900 GB/s" both directions joins the Grace CPU to the superchip's
#   two B200 GPUs (GB200 NVL72 page): a quarter of it per GPU and direction.
_NVLINK_C2C_SHARED = 225e9
#   MI300X: 7 Infinity Fabric links, "896 GB/s" peak aggregate bidirectional (MI300X data
#   sheet); one link (64 GB/s a direction) joins each pair of the 8 GPUs of a platform.
_INFINITY_FABRIC = 448e9
#   MI325X: the MI300X's seven links (AMD MI325X platform data: "896 GB/s"). MI355X: "7 x 153.6
#   GB/s" Infinity Fabric (AMD Instinct MI355X brochure), 1,075 GB/s both directions.
_INFINITY_FABRIC_4 = 537.6e9
# Typical network per GPU in clusters built around each GPU, one direction.  Overridable: a
# property of the cluster, not the GPU.  DGX/HGX H100 and H200 have one 400 Gb/s NDR
# InfiniBand (or 400G Ethernet) port per GPU (DGX H100 user guide), DGX A100 one 200 Gb/s HDR
# port per GPU (DGX A100 user guide); PCIe-card and older servers are assumed to have 100 Gb/s.
# DGX B200 has one ConnectX-7 400 Gb/s port per GPU, DGX B300 one ConnectX-8 800 Gb/s (DGX
# B200 and B300 pages; HGX page: "Networking Bandwidth 1.6 TB/s" per B300 board, 0.8 per
# B200); GB200 NVL72 trays one ConnectX-7 400 Gb/s per GPU (MLPerf Training system
# descriptions, "4x CX-7 NDR 400G" per 4-GPU tray). AMD platforms' networks are the OEM's:
# 400 Gb/s per GPU is assumed, as for the MI300X.
_NET_800G = 100e9
_NET_400G = 50e9
_NET_200G = 25e9
_NET_100G = 12.5e9
DEFAULT_INTER_NODE_BANDWIDTH = _NET_100G
"""The network per GPU (bytes/s, one direction) assumed where none is known: 100 Gb/s."""

# Dense peaks from the vendor datasheets.  Datasheets print the 2:4-sparsity figure for tensor
# cores (marked with an asterisk); those are halved here.  Training kernels accumulate in fp32,
# so GeForce cards use the "FP16 Tensor with FP32 accumulate" row, half the fp16-accumulate one.
# Memory and bandwidths come from the same sheets (H100 SXM 3.35 TB/s, PCIe 2 TB/s, NVL 3.9 TB/s;
# H200 4.8 TB/s; A100 80GB SXM 2,039 GB/s, PCIe 1,935 GB/s, 40GB 1,555 GB/s; ...).
#   A100:       NVIDIA A100 Tensor Core GPU datasheet (2021), SXM and PCIe columns.
#   H100:       NVIDIA H100 Tensor Core GPU datasheet (2023): SXM, PCIe and NVL columns.
#   H200/GH200: NVIDIA H200 datasheet (2024), SXM and NVL columns; GH200 Grace Hopper
#               datasheet (96GB HBM3 version, 4 TB/s), same Hopper GPU as the H100 SXM.
#   L40S, L40, L4, A10, RTX A6000: the respective NVIDIA product datasheets.
#   RTX 4090:   NVIDIA Ada Lovelace GPU architecture whitepaper v1.01, appendix table.
#   RTX 3090:   NVIDIA Ampere GA102 GPU architecture whitepaper v2, table 9.
#   V100:       NVIDIA Tesla V100 datasheet (no bf16, no tf32: Volta predates both); V100S PCIe
#               datasheet.
#   MI300X:     AMD Instinct MI300X data sheet (matrix, dense; 5.3 TB/s HBM3).
#   B200:       NVIDIA HGX page, B200 column, per 8 GPUs with sparsity: "FP16/BF16 36 PFLOPS",
#               "TF32 18 PFLOPS", "FP32 600 TFLOPS" (dense per GPU: 2,250, 1,125, 75); Blackwell
#               datasheet, HGX B200: "180 GB HBM3E 7.7 TB/s".
#   GB200:      NVIDIA GB200 NVL72 page, per 72 GPUs, sparse ("Dense is one-half sparse spec
#               shown"): "FP16/BF16 360 PFLOPS", "TF32 180 PFLOPS", "FP32 5,760 TFLOPS",
#               "13.4 TB HBM3e / 576 TB/s" (per GPU: 2,500, 1,250, 80 dense; 8 TB/s).
#   B300:       NVIDIA Blackwell Ultra datasheet, HGX B300: "FP16/BF16 4.5 PFLOPS" (sparse),
#               "TF32 2.2 PFLOPS", "FP32 75 TFLOPS", "270 GB HBM3E | 7.7 TB/s"; the HGX page's
#               36 and 18 PFLOPS per 8 GPUs give the dense 2,250 and 1,125 used here.
#   MI325X:     the MI300X's compute (AMD: same CDNA 3 die and clocks; ROCm's MI300 table),
#               256 GB HBM3E at 6 TB/s (AMD MI325X data sheet).
#   MI355X:     AMD Instinct MI355X brochure: 2.5 PFLOPS dense FP16/BF16 matrix (5 sparse),
#               157.3 TFLOPS FP32 vector, 288 GB HBM3E at 8 TB/s; CDNA 4 has no TF32 matrix
#               path.
# A10G is AWS's variant of the A10 (g5 instances); NVIDIA publishes no separate sheet, AWS lists
# 24 GB and the A10's figures are used.
#
# memory_bytes is the driver's reading: the total nvidia-smi prints (NVML memory.total) with
# 2023+ drivers and the default ECC mode, as seen in published nvidia-smi output; none is a
# datasheet figure converted.  Older drivers report less on some parts (A100 40GB 40536 MiB,
# V100 32GB 32510 MiB, RTX 3090 24268 MiB), and enabling ECC on a GDDR card takes 1/16 (RTX
# A6000 49140 -> 46068 MiB; A10 24564 -> 23028 MiB).  Two are not readings: V100 16GB PCIe is
# assumed equal to the SXM2 16GB's, and MI300X is rocm-smi's VRAM total (205822885888 bytes).
# Blackwell readings: B200 183359 MiB (NVIDIA/TensorRT-LLM issue 10278), GB200 189471 MiB
# (SlinkyProject/slurm-operator docs/installation.md), B300 275040 MiB (a Dell XE9780 test
# log); MI355X 309220868096 bytes (rocm-smi's VRAM total, published output). MI325X is not a
# reading: ROCm's GPU table lists "VRAM (GiB) 256", taken as 256 GiB.
_SPEC_LIST: tuple[GpuSpec, ...] = (
    GpuSpec(
        # Blackwell Ultra on an 8-GPU HGX board.
        key="b300",
        name="NVIDIA B300 SXM 270GB",
        memory_bytes=275040 * MIB,
        peak_flops=_flops(2250, 2250, 1125, 75),
        hbm_bandwidth=7.7e12,
        intra_node_bandwidth=_NVLINK5,
        host_link_bandwidth=_PCIE6,
        inter_node_bandwidth=_NET_800G,
        form_factor="sxm",
    ),
    GpuSpec(
        # The B200 of a GB200 superchip: its NVLink domain is the whole NVL72 rack (plan with
        # --gpus-per-node 72 there); its host link is the NVLink-C2C it shares with its twin.
        key="gb200",
        name="NVIDIA GB200 (B200 of a Grace Blackwell Superchip, 186GB)",
        memory_bytes=189471 * MIB,
        peak_flops=_flops(2500, 2500, 1250, 80),
        hbm_bandwidth=8.0e12,
        intra_node_bandwidth=_NVLINK5,
        host_link_bandwidth=_NVLINK_C2C_SHARED,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="b200",
        name="NVIDIA B200 SXM 180GB",
        memory_bytes=183359 * MIB,
        peak_flops=_flops(2250, 2250, 1125, 75),
        hbm_bandwidth=7.7e12,
        intra_node_bandwidth=_NVLINK5,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="h100-80gb",
        name="NVIDIA H100 SXM5 80GB",
        memory_bytes=81559 * MIB,
        peak_flops=_flops(989.4, 989.4, 494.7, 66.9),
        hbm_bandwidth=3.35e12,
        intra_node_bandwidth=_NVLINK4,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        # The NVLink bridge (600 GB/s) joins pairs of cards only; a node's collectives cross PCIe.
        key="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        memory_bytes=81559 * MIB,
        peak_flops=_flops(756.5, 756.5, 378, 51.2),
        hbm_bandwidth=2.0e12,
        intra_node_bandwidth=_PCIE5,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="pcie",
    ),
    GpuSpec(
        # NVLink bridge (600 GB/s) between pairs only, as on the H100 PCIe.
        key="h100-nvl",
        name="NVIDIA H100 NVL 94GB",
        memory_bytes=95830 * MIB,
        peak_flops=_flops(835.5, 835.5, 417.5, 60),
        hbm_bandwidth=3.9e12,
        intra_node_bandwidth=_PCIE5,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="h200",
        name="NVIDIA H200 SXM 141GB",
        memory_bytes=143771 * MIB,
        peak_flops=_flops(989.4, 989.4, 494.7, 66.9),
        hbm_bandwidth=4.8e12,
        intra_node_bandwidth=_NVLINK4,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        # 2- or 4-way NVLink bridges (900 GB/s) join groups of cards; an 8-card node's
        # collectives still cross PCIe.
        key="h200-nvl",
        name="NVIDIA H200 NVL 141GB",
        memory_bytes=143771 * MIB,
        peak_flops=_flops(835.5, 835.5, 417.5, 60),
        hbm_bandwidth=4.8e12,
        intra_node_bandwidth=_PCIE5,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="pcie",
    ),
    GpuSpec(
        # Nodes of 4 superchips link every pair by NVLink 4 (150 GB/s a direction), 450 GB/s
        # per GPU in all.  The host link is NVLink-C2C to the Grace CPU's LPDDR5X.
        key="gh200",
        name="NVIDIA GH200 Grace Hopper Superchip (96GB HBM3)",
        memory_bytes=97871 * MIB,
        peak_flops=_flops(989.4, 989.4, 494.7, 66.9),
        hbm_bandwidth=4.0e12,
        intra_node_bandwidth=_NVLINK4,
        host_link_bandwidth=_NVLINK_C2C,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="a100-80gb",
        name="NVIDIA A100 SXM4 80GB",
        memory_bytes=81920 * MIB,
        peak_flops=_flops(312, 312, 156, 19.5),
        hbm_bandwidth=2.039e12,
        intra_node_bandwidth=_NVLINK3,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_200G,
        form_factor="sxm",
    ),
    GpuSpec(
        # NVLink bridge (600 GB/s) between pairs only.
        key="a100-80gb-pcie",
        name="NVIDIA A100 PCIe 80GB",
        memory_bytes=81920 * MIB,
        peak_flops=_flops(312, 312, 156, 19.5),
        hbm_bandwidth=1.935e12,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_200G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="a100-40gb",
        name="NVIDIA A100 SXM4 40GB",
        memory_bytes=40960 * MIB,
        peak_flops=_flops(312, 312, 156, 19.5),
        hbm_bandwidth=1.555e12,
        intra_node_bandwidth=_NVLINK3,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_200G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="a100-40gb-pcie",
        name="NVIDIA A100 PCIe 40GB",
        memory_bytes=40960 * MIB,
        peak_flops=_flops(312, 312, 156, 19.5),
        hbm_bandwidth=1.555e12,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_200G,
        form_factor="pcie",
    ),
    GpuSpec(
        # No NVLink on the L40S, L40, L4, A10 and RTX 4090: peers talk over PCIe.
        key="l40s",
        name="NVIDIA L40S",
        memory_bytes=46068 * MIB,
        peak_flops=_flops(362.05, 362.05, 183, 91.6),
        hbm_bandwidth=864e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="l40",
        name="NVIDIA L40",
        memory_bytes=46068 * MIB,
        peak_flops=_flops(181, 181, 90.5, 90.5),
        hbm_bandwidth=864e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="l4",
        name="NVIDIA L4",
        memory_bytes=23034 * MIB,
        peak_flops=_flops(121, 121, 60, 30.3),
        hbm_bandwidth=300e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="a10",
        name="NVIDIA A10",
        memory_bytes=23028 * MIB,
        peak_flops=_flops(125, 125, 62.5, 31.2),
        hbm_bandwidth=600e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="a10g",
        name="NVIDIA A10G (AWS)",
        memory_bytes=23028 * MIB,
        peak_flops=_flops(125, 125, 62.5, 31.2),
        hbm_bandwidth=600e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        # NVLink bridge (112.5 GB/s) between pairs only.
        key="a6000",
        name="NVIDIA RTX A6000",
        memory_bytes=49140 * MIB,
        peak_flops=_flops(154.8, 154.8, 77.4, 38.7),
        hbm_bandwidth=768e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        # GeForce drivers disable peer-to-peer: NCCL stages GPU-to-GPU traffic through host
        # memory, so real collectives get less than the PCIe figure.
        key="rtx4090",
        name="NVIDIA GeForce RTX 4090",
        memory_bytes=24564 * MIB,
        peak_flops=_flops(165.2, 165.2, 82.6, 82.6),
        hbm_bandwidth=1008e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        # NVLink bridge (112.5 GB/s) between pairs only.
        key="rtx3090",
        name="NVIDIA GeForce RTX 3090",
        memory_bytes=24576 * MIB,
        peak_flops=_flops(71, 71, 35.6, 35.6),
        hbm_bandwidth=936e9,
        intra_node_bandwidth=_PCIE4,
        host_link_bandwidth=_PCIE4,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="v100-32gb",
        name="NVIDIA Tesla V100 SXM2 32GB",
        memory_bytes=32768 * MIB,
        peak_flops=_flops(None, 125, None, 15.7),
        hbm_bandwidth=900e9,
        intra_node_bandwidth=_NVLINK2,
        host_link_bandwidth=_PCIE3,
        inter_node_bandwidth=_NET_100G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="v100-16gb",
        name="NVIDIA Tesla V100 SXM2 16GB",
        memory_bytes=16384 * MIB,
        peak_flops=_flops(None, 125, None, 15.7),
        hbm_bandwidth=900e9,
        intra_node_bandwidth=_NVLINK2,
        host_link_bandwidth=_PCIE3,
        inter_node_bandwidth=_NET_100G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="v100-32gb-pcie",
        name="NVIDIA Tesla V100 PCIe 32GB",
        memory_bytes=32768 * MIB,
        peak_flops=_flops(None, 112, None, 14),
        hbm_bandwidth=900e9,
        intra_node_bandwidth=_PCIE3,
        host_link_bandwidth=_PCIE3,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="v100-16gb-pcie",
        name="NVIDIA Tesla V100 PCIe 16GB",
        memory_bytes=16384 * MIB,
        peak_flops=_flops(None, 112, None, 14),
        hbm_bandwidth=900e9,
        intra_node_bandwidth=_PCIE3,
        host_link_bandwidth=_PCIE3,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        key="v100s",
        name="NVIDIA Tesla V100S PCIe 32GB",
        memory_bytes=32768 * MIB,
        peak_flops=_flops(None, 130, None, 16.4),
        hbm_bandwidth=1134e9,
        intra_node_bandwidth=_PCIE3,
        host_link_bandwidth=_PCIE3,
        inter_node_bandwidth=_NET_100G,
        form_factor="pcie",
    ),
    GpuSpec(
        # OAM module on an 8-GPU platform, counted as "sxm"; rocm-smi's total, not nvidia-smi's.
        key="mi300x",
        name="AMD Instinct MI300X",
        memory_bytes=205822885888,
        peak_flops=_flops(1307.4, 1307.4, 653.7, 163.4),
        hbm_bandwidth=5.3e12,
        intra_node_bandwidth=_INFINITY_FABRIC,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="mi325x",
        name="AMD Instinct MI325X",
        memory_bytes=256 * 1024 * MIB,
        peak_flops=_flops(1307.4, 1307.4, 653.7, 163.4),
        hbm_bandwidth=6.0e12,
        intra_node_bandwidth=_INFINITY_FABRIC,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
    GpuSpec(
        key="mi355x",
        name="AMD Instinct MI355X",
        memory_bytes=309220868096,
        peak_flops=_flops(2500, 2500, None, 157.3),
        hbm_bandwidth=8.0e12,
        intra_node_bandwidth=_INFINITY_FABRIC_4,
        host_link_bandwidth=_PCIE5,
        inter_node_bandwidth=_NET_400G,
        form_factor="sxm",
    ),
)
SPECS: Mapping[str, GpuSpec] = MappingProxyType({spec.key: spec for spec in _SPEC_LIST})
"""The catalogue by key, in catalogue order (newest NVIDIA data-centre parts first)."""


def cpu_device_spec(device_memory_bytes: int) -> GpuSpec:
    """A GpuSpec standing for the CPU under an emulated device cap (real CPU probes).

    Its speeds only order the first probes; the search rescales predictions by what the
    probes measure. Its memory is the emulated cap.

    Args:
        device_memory_bytes: The emulated device memory per rank (``--device-memory``).

    Returns:
        The spec, keyed ``cpu``.
    """
    return GpuSpec(
        key="cpu",
        name="CPU (emulated device memory)",
        memory_bytes=device_memory_bytes,
        peak_flops={"bf16": 1e11, "fp16": 1e11, "fp32": 1e11},
        hbm_bandwidth=20e9,
        intra_node_bandwidth=5e9,
        host_link_bandwidth=20e9,
        inter_node_bandwidth=1e9,
        form_factor="pcie",
    )

"""Time of one training step of a configuration on a GPU that is not here, in closed form.

The model predicts what the probe measures: the time of one micro-step (forward and backward,
recomputation included, with the gradient reduction of the accumulation boundary) and the time
of one optimizer step.  Each is built from parts that map onto what the engines do:

- **compute**: dense matmuls at the GPU's measured matmul efficiency, flash attention at its
  published efficiency, and the memory-bound rest of a Hugging Face decoder block (norms in
  fp32, rotary embeddings, activations, casts) as bytes over HBM bandwidth; combined with
  the host's cost of dispatching the eager operators, which dominates small micro-batches;
- **communication**: NCCL ring collectives (bandwidth and latency terms as NCCL's own tuning
  model has them) of the bytes each engine moves, minus what overlaps with compute;
- **offload**: PCIe transfers of gradients and parameters, and Adam on the host's cores;
- **optimizer**: fused Adam streaming its states through HBM.

All constants, their sources and the assumptions are in docs/time-model.md.  An evaluation
takes tens of microseconds: a planner can score thousands of configurations in well under a
second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autotune.config import (
    LOSS_CHUNK_TOKENS,
    Attention,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
)
from autotune.estimator.activations import Regime, activation_profile, regime_of
from autotune.estimator.memory import offloaded_activation_bytes
from autotune.hardware.specs import GpuSpec
from autotune.models import ModelSpec

__all__ = ["StepTime", "collective_seconds", "predict_step_time"]

# --- GPU efficiencies -------------------------------------------------------------------------

# Maximum achievable matmul FLOP/s over the dense peak, bf16, measured with mamf-finder.py
# (S. Bekman, "Machine Learning Engineering", compute/accelerator, MAMF comparison table).
_MATMUL_EFFICIENCY: dict[str, float] = {
    "a100-80gb": 0.869,
    "a100-40gb": 0.869,
    "a100-80gb-pcie": 0.811,
    "a100-40gb-pcie": 0.811,
    "h100-80gb": 0.803,
    "h200": 0.803,  # the table notes that H200 measures the same as H100 SXM
    "gh200": 0.838,
    "mi300x": 0.514,
}
# GPUs the table does not list: its lowest NVIDIA figure (H100 SXM), rounded.
_MATMUL_EFFICIENCY_DEFAULT = 0.80

# Flash attention, forward + backward, as a fraction of the dense peak, with its FLOPs counted
# as its authors do (causal: half the full score matrix; backward 2.5 forwards).  Hopper: "FA2
# achieves only 35% utilization on H100" (Shah et al. 2024, FlashAttention-3).  Ampere and Ada:
# the low end of "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023, FA2), the
# backward being the slower half.  Elsewhere (Volta and fp32, where PyTorch falls back to the
# memory-efficient kernel; MI300X) the Hopper figure is assumed.
_ATTENTION_EFFICIENCY: dict[str, float] = {"ampere": 0.50, "ada": 0.50}
_ATTENTION_EFFICIENCY_DEFAULT = 0.35

# Sustained fraction of HBM bandwidth for streaming kernels: BabelStream's triad reaches 3.30 of
# 3.9 TB/s on an H100 NVL (BabelStream 5.0, CUDA, double; a run published in a public
# repository; its copy kernel reaches 3.06).
_HBM_EFFICIENCY = 0.85

# What the analytic parts above leave out (clocks under a training load's power draw, gaps
# between kernels, collectives competing with compute for SMs and memory), as one factor on the
# GPU's compute time.  Ampere: fitted to torchtitan's eager FSDP2 run of Llama 2 13B on 64 A100
# 80GB (local batch 2, seq 4096, no checkpointing: 2,162 tokens/s/GPU; torchtitan
# docs/performance.md).  Hopper: fitted with _OVERLAP_NORM to the single rows of
# measurements/h100-2026-11-23 (qwen2.5-1.5b on one H100 80GB SXM, ac:off mbs 1-4, ac:every-4,
# every-2, every); docs/time-model.md shows both fits and what the Hopper one moved.
_SUSTAINED: dict[str, float] = {"ampere": 0.83, "hopper": 0.93}
_SUSTAINED_DEFAULT = 0.83

# --- Decoder-block traffic, measured -----------------------------------------------------------

# Bytes the non-matmul operators of one Hugging Face llama block read and write, per token,
# as coefficients of hidden size d and MLP width i: (forward d, forward i, total d, total i),
# forward + backward in "total".  Counted by a TorchDispatchMode tracer over every operator of
# LlamaForCausalLM (transformers 5.23, torch 2.13) at several shapes; least-squares fits of
# 1-layer and 2-layer differences, residual < 0.5%.  Regimes (activations.regime_of): autocast
# (fp32 weights under bf16/fp16 autocast: single, ddp), low (16-bit weights: fsdp mixed
# precision, deepspeed, pure bf16), fp32.
_BLOCK_TRAFFIC: dict[Regime, tuple[float, float, float, float]] = {
    Regime.AUTOCAST: (179.0, 10.3, 590.0, 28.7),
    Regime.LOW: (125.0, 10.2, 411.0, 28.4),
    Regime.FP32: (161.0, 20.3, 542.0, 56.7),
}
# Autocast also casts each block's weights to 16 bits in the forward and accumulates the 16-bit
# weight gradients into the fp32 ones in the backward: bytes per block parameter (same trace).
_AUTOCAST_WEIGHT_TRAFFIC = (6.0, 12.0)  # (forward, total)
# Outside the blocks (embedding, final norm, lm_head, fp32 cross-entropy), per token:
# (forward per vocab entry, forward per d, total per vocab entry, total per d) (same trace).
_HEAD_TRAFFIC = (19.0, 40.0, 45.0, 140.0)
# Eager attention materializes the T×T scores: non-matmul bytes per token per head per key
# (mask, fp32 softmax, casts), and the score matmuls' own operand bytes (same trace, bf16).
_EAGER_SCORE_TRAFFIC = (25.2, 52.3)  # (forward, total)
_EAGER_SCORE_MATMUL_TRAFFIC = (4.0, 12.0)
# What the matmuls read and write (same trace, 2-byte operands): per token per layer as
# coefficients of d and i, and per block weight element; forward (d, i, weight), then total.
_MATMUL_TRAFFIC = (22.0, 6.0, 2.0, 66.0, 18.0, 6.0)

# Host cost of eager PyTorch: aten operators dispatched per block, forward + backward (same
# trace), times what one dispatch costs the host: 12.1 µs with 16-bit weights, 14.6 µs under
# autocast, timed on a CPU host (torch 2.13 CPU build, one thread, AMD EPYC) where compute is
# negligible.  The GPU runs asynchronously behind the host, so each pass takes the longer of
# the two.
_DISPATCH_S = 12e-6
_DISPATCHES_PER_LAYER = {Regime.AUTOCAST: 243.0, Regime.LOW: 217.0, Regime.FP32: 217.0}
_EAGER_EXTRA_DISPATCHES = 30.0
# LoRA's adapters (peft: beside each linear layer a cast of its input, two small matmuls, a
# scale and an add, and their backward) about double a block's operators: counted with the
# same kind of tracer on a tiny llama at rank 16 (torch 2.13 CPU build, peft 0.21), 421 a block
# in pure bf16, 442 under autocast (bf16-mixed), 378 in fp32; full fine-tuning counts 219, 245
# and 211 there.
_LORA_DISPATCHES_PER_LAYER = {"bf16": 421.0, "mixed": 442.0, "fp32": 378.0}
# LoRA's casts of each adapted layer's input, bytes per input value moved, forward (pure bf16:
# read 2, write 4; under autocast read 2, write 4, read 4, write 2; fp32: none); the backward
# moves as much again. Read from peft's code path, not measured.
_LORA_CAST_BYTES = {"bf16": 6.0, "mixed": 12.0, "fp32": 0.0}
_HEAD_DISPATCHES = 110.0
# The chunked loss (--loss chunked) dispatches per chunk, against the model's own loss:
# (forward per chunk, forward fixed, total per chunk, total fixed), counted the same way on a
# tiny llama at 1, 2 and 4 chunks (226 + 9 a chunk forward, 556 + 37 a chunk in all, against
# 222 and 575).
_CHUNK_DISPATCHES = (9.0, -5.0, 37.0, -19.0)
_FORWARD_SHARE = 0.36  # forward kernels over forward + backward kernels of a block (trace)
# How the host's dispatch time and the GPU's time combine in one pass (_overlap): a p-norm,
# 1 would be their sum, infinity their maximum.  Fitted with the Hopper sustained factor to the
# single ac:off rows of measurements/h100-2026-11-23 (qwen2.5-1.5b, mbs 1, 2, 4: 0.088-0.107,
# 0.140-0.155, 0.251 s), where the host's 0.08 s of dispatch shows at every size.
_OVERLAP_NORM = 2.5
# What each engine's hooks add to the host per block, forward + backward, measured the same way
# (the probe's engines on one CPU rank, 2 to 14 blocks; about ±30% run to run): FSDP2's
# all-gather and reduce-scatter hooks, DeepSpeed ZeRO-1/2's gradient hooks, ZeRO-3's
# per-module fetch and release (which also blocks the host once two fetches are in flight,
# partitioned_param_coordinator.py), plus ZeRO-3's fixed cost per micro-step.
_ENGINE_HOST_PER_LAYER_S = {Engine.FSDP: 1.5e-3, Engine.DEEPSPEED: 1.9e-3}
_ZERO3_HOST_PER_LAYER_S = 12.4e-3
_ZERO3_HOST_FIXED_S = 15e-3

# --- Communication -----------------------------------------------------------------------------

# NCCL's topology model counts 20 GB/s per NVLink on Volta and Ampere and 20.6 GB/s on Hopper
# against the 25 GB/s links carry (NCCL src/graph/topo.h, SM70/SM80/SM90_NVLINK_BW); a 100 Gb/s
# NIC as 12 GB/s of 12.5 (NET_BW).  PCIe figures in the catalogue are already effective.
_NVLINK_EFFICIENCY = {"hopper": 20.6 / 25.0}
_NVLINK_EFFICIENCY_DEFAULT = 20.0 / 25.0
_NETWORK_EFFICIENCY = 12.0 / 12.5

# NCCL ring latencies, µs (NCCL src/graph/tuning.cc, baseLat and hwLat): a base per protocol
# plus a per-step latency over NVLink, PCIe or the network.  Protocols: LL, LL128, Simple, with
# their bandwidth factors (LL: 1/4 for all-reduce and across nodes, else 1/3; LL128: 0.92).
_RING_BASE_US = (6.6, 14.0, 8.4)
_RING_HOP_US = {"nvlink": (0.6, 1.9, 3.4), "pcie": (1.0, 2.5, 5.7), "net": (2.7, 4.0, 14.0)}

# DDP buckets gradients in 25 MiB (bucket_cap_mb) and overlaps each bucket's all-reduce with
# the rest of the backward (Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3).
_DDP_BUCKET_BYTES = 25 * 1024**2

# --- Offload -----------------------------------------------------------------------------------

# FSDP2's CPUOffloadPolicy copies each block's fp32 shard to the GPU before its all-gather and
# each fp32 gradient shard back after its reduce-scatter, one flat copy per block: the
# fraction of the catalogue's pinned-copy rate it reaches.  Fitted to llama-7b-run-2 of
# measurements/h100-2026-11-23 (fsdp z3 off:params ac:every-4 mbs 4, 1.877 s: 80 GB cross
# PCIe, which bounds the micro-step); grid-4's micro-step (qwen2.5-1.5b, 0.492 s) is then
# predicted 15% short.
_FSDP_COPY_EFFICIENCY = 0.86
# Activation offload's copies (pinned host buffers, a few MB to a few hundred MB each) are
# assumed to move at FSDP2's measured rate; not measured on a GPU yet.
_ACTIVATION_COPY_EFFICIENCY = _FSDP_COPY_EFFICIENCY
# DeepSpeed copies per parameter: each gradient converted to fp32 on the GPU and copied to the
# host's fp32 partition (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu,
# stage3.py partition_grads), the updated fp32 partition copied back into the 16-bit one after
# the host step (PyTorch converts on the GPU when the destination is a GPU tensor,
# aten/src/ATen/native/cuda/Copy.cu), both through one stream, not overlapped with the pass at
# one GPU.  Fitted to measurements/h100-2026-11-23, qwen2.5-1.5b-run-0 and -run-2 (deepspeed
# z2 and z3 off:optimizer, mbs 4 and 8): 0.22-0.27 s per micro-step above the compute for the
# 6.2 GB fp32 gradient, about 25 GB/s.
_DEEPSPEED_COPY_EFFICIENCY = 0.5
# Adam on the host, parameters per second per core: torch's fused AdamW on the CPU (FSDP2's
# offload) and DeepSpeedCPUAdam are both memory-bound loops vectorized over the cores the
# rank's threads get (the probe gives each rank cpu_count / ranks threads).  Fitted to the
# fsdp off:params rows of measurements/h100-2026-11-23 on 16 cores: 0.325 s for qwen2.5-1.5b
# (grid-4), 1.355 s for llama-7b (llama-7b-run-2), less FSDP2's per-block step cost: 3.07e8
# and 3.14e8.  DeepSpeed's z2 off:optimizer step (0.535-0.568 s, qwen2.5-1.5b-run-0, grid-6) is
# then this Adam plus the fp32 upload at the rate above.  (ZeRO-Offload's DeepSpeedCPUAdam did
# 10B parameters in 2.57 s on 48 Skylake cores, 0.8e8 per core: Ren et al. 2021, table 4.)
_HOST_ADAM_PARAMS_PER_CORE_S = 3.1e8
# ZeRO-3's host step does more than Adam over the fp32 partition: its z3 off:optimizer step
# takes 1.256-1.277 s where ZeRO-2's takes 0.535-0.568 s for the same model, Adam and upload
# (measurements/h100-2026-11-23, qwen2.5-1.5b-run-2 against -run-0); the difference, 0.70 s
# for 1.54B parameters on 16 cores, is charged per parameter and core like Adam.  What it is
# was not traced: stage3.py's step also checks the host gradients for overflow and takes their
# norm, passes over the fp32 partition on the host.
_ZERO3_HOST_STEP_PARAMS_PER_CORE_S = 1.4e8
# Host cores per GPU when the caller does not say: the H100 node of measurements/h100-2026-11-23
# (16 cores, one GPU); a DGX H100 has 112 for 8.
_HOST_CORES_PER_GPU = 16

# --- Optimizer ---------------------------------------------------------------------------------

# Fused Adam's sustained fraction of HBM bandwidth: torch's fused AdamW over the fp32 states of
# qwen2.5-1.5b (1.54B parameters, 28 bytes each) takes 0.018-0.020 s on the H100
# (measurements/h100-2026-11-23, the single rows' optimizer_step_s).
_ADAM_HBM_EFFICIENCY = 0.68
# FSDP2 steps the same fused AdamW over DTensors, which costs the host time per block on top:
# 0.031 s against single's 0.019-0.020 s for the same model and optimizer (c1-fsdp-0 against
# the single rows, 28 blocks).
_FSDP_STEP_HOST_PER_LAYER_S = 0.4e-3

# torchao's AdamW8bit calls a torch.compile'd function per parameter tensor, whose host time
# (guards, the 8-bit state's flatten and unflatten) bounds a step of many tensors while the
# GPU's kernels wait: 254 us a tensor of 4,096 values on this project's 2-core CPU, where
# fused AdamW takes 5 (bench/optimizer_step.py; a GPU node's cores are faster, so an upper
# estimate). Its kernels are assumed to stream the moments no faster than fused AdamW: the
# codes are a quarter of the bytes, but each value is dequantized and searched for its new
# code (unmeasured on a GPU).
_COMPILED_STEP_CALL_S = 250e-6

# DeepSpeed's step per parameter of the partition, beyond Adam's 7 state reads and writes: the
# 16-bit gradient partition converted to fp32 (2 read, 4 written), the global gradient norm
# (4 read), the updated fp32 weights copied into the 16-bit ones (4 read, 2 written).
_DEEPSPEED_STEP_EXTRA_BYTES = 16.0


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Predicted time of one training step, in the two parts the probe measures.

    The probe times micro-steps and optimizer steps apart; with its default of one micro-step
    per step every micro-step ends at the accumulation boundary and reduces gradients.
    ``micro_step_s`` is that boundary micro-step, as ``autotune.probe.metrics.throughput``
    assumes (its ``step = grad_accum * micro_step + optimizer_step`` over-estimates a step
    slightly when micro-steps in between reduce nothing); ``exact_step_s`` counts those at
    their own time.
    """

    compute_s: float
    """Forward + backward (+ recomputation) of one micro-step: matmuls, attention and the
    memory-bound rest on the GPU, or the host's dispatch time when that is longer."""
    communication_s: float
    """Collective time of the boundary micro-step not hidden behind compute."""
    offload_s: float
    """PCIe time of the boundary micro-step not hidden (offloaded gradients and parameters)."""
    micro_step_s: float
    """``compute_s + communication_s + offload_s``: the micro-step that reduces gradients."""
    accumulation_micro_step_s: float
    """A micro-step inside the accumulation window (DDP and FSDP skip the reduction there;
    DeepSpeed ZeRO-2/3 reduce on every micro-step)."""
    optimizer_step_s: float
    """Optimizer step: fused Adam over HBM, or Adam on the host plus the parameter upload,
    plus DeepSpeed ZeRO-1/2's all-gather of the updated parameters."""
    step_s: float
    """``grad_accum * micro_step_s + optimizer_step_s``, as ``metrics.throughput`` computes."""
    exact_step_s: float
    """``(grad_accum - 1) * accumulation_micro_step_s + micro_step_s + optimizer_step_s``."""
    tokens_per_second: float
    """All ranks, from ``step_s`` (as ``metrics.throughput``)."""
    mfu: float | None
    """Model FLOPs utilization, as ``metrics.throughput``: model FLOPs 6·N + 12·L·H·Q·T."""
    hfu: float | None
    """Hardware FLOPs utilization: MFU plus recomputation."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the model contributes to the time model, read once from its config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    head_dim: int
    vocab: int
    params: int
    block_params: int
    matmul_params: int
    tensors: int
    """Parameter tensors (an 8-bit optimizer steps each in a call of its own)."""
    linear_features: int
    """Σ (in + out) over a block's linear layers: LoRA's adapter parameters per block per rank."""
    linear_inputs: int
    """Σ in over a block's linear layers: what LoRA casts for its adapters, per token."""
    flops_per_token_fixed: float
    """6·N_matmul: model FLOPs per token that do not depend on the sequence length."""


_SHAPES: dict[ModelSpec, _Shape] = {}


def _shape(model: ModelSpec) -> _Shape:
    """The model's numbers in one object, cached by spec (equal name and config fields)."""
    cached = _SHAPES.get(model)
    if cached is not None:
        return cached
    shape = _Shape(
        layers=model.num_layers,
        hidden=model.hidden_size,
        intermediate=model.intermediate_size,
        heads=model.num_attention_heads,
        head_dim=model.head_dim,
        vocab=model.vocab_size,
        params=model.num_params,
        block_params=model.num_block_params,
        matmul_params=model.num_matmul_params,
        tensors=sum(count for _, count in model.parameter_tensors),
        linear_features=sum(i + o for i, o in model.block_linears),
        linear_inputs=sum(i for i, _ in model.block_linears),
        flops_per_token_fixed=6.0 * model.num_matmul_params,
    )
    if len(_SHAPES) >= 256:
        _SHAPES.clear()
    _SHAPES[model] = shape
    return shape


_ARCHITECTURES: dict[tuple[str, str], str] = {}


def _architecture(gpu: GpuSpec) -> str:
    """GPU family from the catalogue key or marketing name: what the efficiencies depend on.

    A GPU no rule recognizes (a GPU file for a newer part) gets the Ampere constants.
    """
    cache_key = (gpu.key, gpu.name)
    arch = _ARCHITECTURES.get(cache_key)
    if arch is None:
        text = f"{gpu.key} {gpu.name}".lower()
        if any(tag in text for tag in ("h100", "h200", "gh200", "h800", "hopper")):
            arch = "hopper"
        elif "v100" in text or "volta" in text:
            arch = "volta"
        elif "mi300" in text or "instinct" in text:
            arch = "cdna"
        elif any(tag in text for tag in ("l40", "l4", "4090", "ada")):
            arch = "ada"
        else:
            arch = "ampere"
        _ARCHITECTURES[cache_key] = arch
    return arch


@dataclass(frozen=True, slots=True)
class _Fabric:
    """The links one data-parallel group's collectives run over, per NCCL protocol."""

    ranks: int
    all_reduce: tuple[tuple[float, float], ...]
    """(latency seconds per call, effective bytes/s) of a ring all-reduce, one per protocol."""
    gather: tuple[tuple[float, float], ...]
    """The same for a ring all-gather or reduce-scatter."""


_FABRICS: dict[tuple[Any, ...], _Fabric] = {}


def _fabric(gpu: GpuSpec, arch: str, world_size: int, gpus_per_node: int) -> _Fabric:
    """Ring bandwidth and latency of the data-parallel group, for each NCCL protocol.

    Inside a node a ring edge is the GPU's fabric link.  Across nodes NCCL runs one ring per
    NIC (rail), each crossing the network once per node: a GPU's share of a collective leaves
    the node through all ``ranks_per_node`` NICs at once, so the network edge is
    ``ranks_per_node`` NICs wide, and the ring is as fast as its slower edge type.  Latency
    is NCCL's ring model: a base plus one hop latency per ring step, network hops for the
    steps that cross nodes.
    """
    key: tuple[Any, ...] = (gpu.key, gpu.form_factor, gpu.intra_node_bandwidth, arch)
    key += (gpu.inter_node_bandwidth, world_size, gpus_per_node)
    fabric = _FABRICS.get(key)
    if fabric is not None:
        return fabric
    nodes = math.ceil(world_size / gpus_per_node)
    nvlink = gpu.form_factor == "sxm"
    efficiency = _NVLINK_EFFICIENCY.get(arch, _NVLINK_EFFICIENCY_DEFAULT) if nvlink else 1.0
    bandwidth = gpu.intra_node_bandwidth * efficiency
    if nodes > 1:
        network = world_size / nodes * gpu.inter_node_bandwidth * _NETWORK_EFFICIENCY
        bandwidth = min(bandwidth, network)
    hops = _RING_HOP_US["nvlink" if nvlink else "pcie"]
    net_hops = _RING_HOP_US["net"]

    def options(all_reduce: bool) -> tuple[tuple[float, float], ...]:
        steps = 2 * (world_size - 1) if all_reduce else world_size - 1
        # Steps that cross the network (NCCL counts 2·nodes for a ring all-reduce).
        inter = (2 * nodes if all_reduce else nodes - 1) if nodes > 1 else 0
        inter = min(inter, steps)
        ll_factor = 0.25 if all_reduce or nodes > 1 else 1.0 / 3.0
        factors = (ll_factor, 0.92 if nvlink else 0.0, 1.0)  # NCCL runs LL128 on NVLink only
        result = []
        for protocol, factor in enumerate(factors):
            if factor > 0.0:
                latency_us = (
                    _RING_BASE_US[protocol]
                    + (steps - inter) * hops[protocol]
                    + inter * net_hops[protocol]
                )
                result.append((latency_us * 1e-6, bandwidth * factor))
        return tuple(result)

    fabric = _Fabric(world_size, options(True), options(False))
    if len(_FABRICS) >= 1024:
        _FABRICS.clear()
    _FABRICS[key] = fabric
    return fabric


def _collective(fabric: _Fabric, kind: str, nbytes: float, calls: int = 1) -> float:
    """Seconds of ``calls`` ring collectives moving ``nbytes`` in all (the unsharded size).

    ``kind``: ``ar`` (all-reduce: 2(N-1)/N of the bytes cross each rank's link), ``ag`` or
    ``rs`` (all-gather, reduce-scatter: (N-1)/N), the bus-bandwidth convention of nccl-tests
    (doc/PERFORMANCE.md).  NCCL picks the fastest protocol for the size, and so does this.
    """
    n = fabric.ranks
    if n <= 1 or nbytes <= 0.0:
        return 0.0
    if kind == "ar":
        volume, options = 2.0 * (n - 1) / n * nbytes, fabric.all_reduce
    else:
        volume, options = (n - 1) / n * nbytes, fabric.gather
    return min(calls * latency + volume / bandwidth for latency, bandwidth in options)


def collective_seconds(
    gpu: GpuSpec, kind: str, nbytes: float, *, ranks: int, ranks_per_node: int, calls: int = 1
) -> float:
    """Seconds of ``calls`` ring collectives (``ar``, ``ag`` or ``rs``) moving ``nbytes`` in
    all over a group of ``ranks`` GPUs, ``ranks_per_node`` of them on each node: the data
    parallel group's model (:func:`_fabric`, :func:`_collective`) for any group, as a tensor
    parallel one's inside a node."""
    fabric = _fabric(gpu, _architecture(gpu), ranks, ranks_per_node)
    return _collective(fabric, kind, nbytes, calls)


def _exposed(comm: float, chunks: int, compute: float, floor: float) -> float:
    """Communication left exposed when ``chunks`` equal transfers pipeline with compute.

    Transfer k can run while the compute of chunk k-1 (or k+1) does, one at a time on its
    stream, so the compute hides at most ``(chunks - 1) / chunks`` of itself; ``floor`` is
    what can never hide (the first gather, the last reduction).
    """
    if comm <= 0.0:
        return 0.0
    hidden = compute * (chunks - 1) / chunks if chunks > 1 else 0.0
    return max(floor, comm - hidden, 0.0)


@dataclass(frozen=True, slots=True)
class _Compute:
    """Seconds of one micro-step's passes on one rank, before any communication."""

    forward: float
    backward: float
    """Including the recomputed forwards of checkpointed blocks."""


def _compute(
    shape: _Shape,
    config: TrainConfig,
    gpu: GpuSpec,
    arch: str,
    peak: float,
    tokens: float,
    seq_len: int,
    fraction: float,
    sequence_share: float = 1.0,
) -> _Compute:
    """Forward and backward seconds of one micro-step of ``tokens`` tokens on one GPU
    (``sequence_share``: :func:`predict_step_time`'s)."""
    regime = regime_of(config)
    fp32 = config.precision is Precision.FP32
    operand = 2.0 if fp32 else 1.0  # matmul operand bytes relative to 16-bit
    mm_eff = _MATMUL_EFFICIENCY.get(gpu.key, _MATMUL_EFFICIENCY_DEFAULT)
    hbm = gpu.hbm_bandwidth * _HBM_EFFICIENCY
    n, d, i, layers = float(tokens), shape.hidden, shape.intermediate, shape.layers
    layer_params = shape.block_params / layers
    heads_keys = shape.heads * seq_len  # per token per layer: one score per head per key

    # Dense matmuls, roofline of compute and operand traffic (weights matter at small batches).
    # LoRA's frozen weights need no weight gradient: the backward makes the inputs' alone
    # (Hu et al. 2021), and the adapters' small matmuls run beside (2 FLOPs a parameter forward,
    # 4 backward, again forward in a recomputed block).
    mm_f = 2.0 * shape.matmul_params * n
    lora = config.is_lora
    mm_b = (1.0 if lora else 2.0) * mm_f + fraction * 2.0 * shape.block_params * n
    adapters = _adapters(shape, config)
    mm_f += 2.0 * adapters * n
    mm_b += (4.0 + 2.0 * fraction) * adapters * n
    tf = _MATMUL_TRAFFIC
    bytes_f = operand * (
        layers * (n * (tf[0] * d + tf[1] * i) + tf[2] * layer_params)
        + (2.0 * n + 2.0 * d) * shape.vocab
    )
    bytes_t = operand * (
        layers * (n * (tf[3] * d + tf[4] * i) + tf[5] * layer_params)
        + (6.0 * n + 6.0 * d) * shape.vocab
    )
    # Without weight gradients the backward's matmuls move about half (assumed, not measured).
    backward_share = 0.5 if lora else 1.0
    bytes_b = backward_share * (bytes_t - bytes_f) + fraction * (
        bytes_f - operand * (2.0 * n + 2.0 * d) * shape.vocab
    )
    t_f = max(mm_f / (mm_eff * peak), bytes_f / hbm)
    t_b = max(mm_b / (mm_eff * peak), bytes_b / hbm)

    # Attention: flash kernels (sdpa), or materialized scores (eager).
    score_flops_f = 4.0 * shape.heads * shape.head_dim * seq_len * n * layers  # full T×T
    if config.attention is not Attention.EAGER:
        # PyTorch's flash kernel needs 16-bit inputs and sm80+; otherwise the memory-efficient
        # one. flash-attn's FlashAttention-2 is taken at the same efficiency (not measured).
        flash = not fp32 and arch in ("ampere", "ada", "hopper")
        eff = _ATTENTION_EFFICIENCY.get(arch, _ATTENTION_EFFICIENCY_DEFAULT)
        if not flash:
            eff = _ATTENTION_EFFICIENCY_DEFAULT
        causal_f = 0.5 * score_flops_f
        t_f += causal_f / (eff * peak)
        t_b += (2.5 + fraction) * causal_f / (eff * peak)
    else:
        s_mm_f, s_mm_t = _EAGER_SCORE_MATMUL_TRAFFIC
        s_f, s_t = _EAGER_SCORE_TRAFFIC
        scores = n * heads_keys * layers
        t_f += max(score_flops_f / (mm_eff * peak), operand * s_mm_f * scores / hbm)
        t_f += s_f * scores / hbm
        b_flops = (2.0 + fraction) * score_flops_f
        b_bytes = operand * (s_mm_t - s_mm_f + fraction * s_mm_f) * scores
        t_b += max(b_flops / (mm_eff * peak), b_bytes / hbm)
        t_b += (s_t - s_f + fraction * s_f) * scores / hbm

    # Memory-bound rest: norms, rotary, activation functions, casts, the fp32 loss.
    a_f, b_f, a_t, b_t = _BLOCK_TRAFFIC[regime]
    wide = d * sequence_share  # the residual stream's operators: 1 / tp of it under SP
    block_f = layers * n * (a_f * wide + b_f * i)
    block_t = layers * n * (a_t * wide + b_t * i)
    if regime is Regime.AUTOCAST:
        w_f, w_t = _AUTOCAST_WEIGHT_TRAFFIC
        block_f += w_f * shape.block_params
        block_t += w_t * shape.block_params
    if lora:
        cast = _LORA_CAST_BYTES[_lora_kind(config)] * shape.linear_inputs * n * layers
        block_f += cast
        block_t += 2.0 * cast
    h_fv, h_fd, h_tv, h_td = _HEAD_TRAFFIC
    head_f = n * (h_fv * shape.vocab + h_fd * wide)
    head_t = n * (h_tv * shape.vocab + h_td * wide)
    if config.loss is Loss.FUSED:
        # Liger's kernel reads each chunk's logits and writes their gradient in place, and the
        # two gradient matmuls read it again, all in the forward (assumed from its source, not
        # measured); the backward only hands the gradients on. The output layer's two
        # backward matmuls move into the forward.
        logits_bytes = 4.0 if fp32 else 2.0
        head_f = n * (3.0 * logits_bytes * shape.vocab + h_fd * d)
        head_t = head_f + n * (h_td - h_fd) * d
        moved = 4.0 * d * shape.vocab * n
        t_f += moved / (mm_eff * peak)
        t_b -= min(t_b, moved / (mm_eff * peak))
    # Op-level selective checkpointing runs the memory-bound rest of each block it covers
    # again in the backward (its matmuls and attention are kept, not recomputed).
    selective = (1.0 - fraction) if config.ac_ops else 0.0
    t_f += (block_f + head_f) / hbm
    t_b += (block_t - block_f + (fraction + selective) * block_f + head_t - head_f) / hbm
    chunked = config.loss is Loss.CHUNKED
    if chunked:
        # The backward makes each chunk's logits again: the output layer's forward matmul and
        # the loss's forward traffic, once more.
        v = shape.vocab
        t_b += max(2.0 * d * v * n / (mm_eff * peak), operand * (2.0 * n + 2.0 * d) * v / hbm)
        t_b += head_f / hbm

    sustained = _SUSTAINED.get(arch, _SUSTAINED_DEFAULT)
    gpu_f, gpu_b = t_f / sustained, t_b / sustained

    # The host dispatches every operator; the GPU cannot run ahead of it.
    per_layer = _DISPATCHES_PER_LAYER[regime]
    if lora:
        per_layer = _LORA_DISPATCHES_PER_LAYER[_lora_kind(config)]
    if config.attention is Attention.EAGER:
        per_layer += _EAGER_EXTRA_DISPATCHES
    # Recomputation dispatches every forward operator again (a selectively kept one too).
    recomputed = (1.0 - _FORWARD_SHARE + (fraction + selective) * _FORWARD_SHARE) * per_layer
    host_f = (_FORWARD_SHARE * per_layer * layers + 0.5 * _HEAD_DISPATCHES) * _DISPATCH_S
    host_b = (recomputed * layers + 0.5 * _HEAD_DISPATCHES) * _DISPATCH_S
    if chunked:
        chunks = math.ceil(n / LOSS_CHUNK_TOKENS)
        per_f, fixed_f, per_t, fixed_t = _CHUNK_DISPATCHES
        host_f += (per_f * chunks + fixed_f) * _DISPATCH_S
        host_b += ((per_t - per_f) * chunks + fixed_t - fixed_f) * _DISPATCH_S
    if config.engine is Engine.DEEPSPEED and config.zero_stage == 3:
        hooks = _ZERO3_HOST_PER_LAYER_S * layers + _ZERO3_HOST_FIXED_S
    elif config.engine is Engine.DEEPSPEED and config.zero_stage == 0:
        hooks = 0.0
    else:
        hooks = _ENGINE_HOST_PER_LAYER_S.get(config.engine, 0.0) * layers
    if config.engine is Engine.DEEPSPEED and config.zero_stage == 3:
        # ZeRO-3's fetches wait on the GPU: its hooks add to the pass instead of overlapping.
        return _Compute(
            _overlap(gpu_f, host_f) + 0.5 * hooks, _overlap(gpu_b, host_b) + 0.5 * hooks
        )
    host_f += 0.5 * hooks
    host_b += 0.5 * hooks
    return _Compute(_overlap(gpu_f, host_f), _overlap(gpu_b, host_b))


def _overlap(gpu: float, host: float) -> float:
    """A pass's time from its GPU time and the host's dispatch time, which run concurrently.

    A pass alternates stretches where the GPU waits on the host (short elementwise kernels)
    with stretches where the host waits on the GPU (matmuls), so neither hides the other
    entirely: the combination is an ``_OVERLAP_NORM``-norm, between their sum and their
    maximum.
    """
    p = _OVERLAP_NORM
    return float((gpu**p + host**p) ** (1.0 / p))


@dataclass(frozen=True, slots=True)
class _Exposed:
    """Seconds of a micro-step that transfers add to its compute."""

    communication: float
    """Collectives not hidden behind compute."""
    offload: float
    """What host-device copies add on top of that."""


def _split(with_pcie: float, without_pcie: float) -> _Exposed:
    """Exposed time split into collectives and PCIe (the difference PCIe makes)."""
    return _Exposed(without_pcie, max(0.0, with_pcie - without_pcie))


def _gpu_adam_bytes(config: TrainConfig) -> float:
    """HBM bytes per parameter of one fused Adam step (reads p, g, m, v; writes p, m, v)."""
    state = 2.0 if config.precision is Precision.BF16 else 4.0
    per_param = 7.0 * state
    if config.engine is Engine.DEEPSPEED:
        per_param += _DEEPSPEED_STEP_EXTRA_BYTES if config.precision is not Precision.FP32 else 4.0
    elif config.precision is Precision.FP16_MIXED:
        per_param += 4.0  # GradScaler's inf/nan check reads the fp32 gradients once
    return per_param


@dataclass(frozen=True, slots=True)
class _Step:
    """What the engine models share: the model, the micro-step's compute, the links."""

    shape: _Shape
    config: TrainConfig
    work: _Compute
    fabric: _Fabric
    host_link: float
    adam_s_per_param: float
    """Seconds of fused Adam on the GPU per parameter of this rank's shard."""
    host_cores: float
    """Host CPU cores this rank's threads get: the node's, shared evenly by its ranks."""

    @property
    def ranks(self) -> int:
        """Data-parallel ranks."""
        return self.fabric.ranks

    @property
    def root(self) -> float:
        """Parameters outside the blocks: embeddings, final norm, an untied lm_head."""
        return float(self.shape.params - self.shape.block_params)

    @property
    def block(self) -> float:
        """Parameters of one decoder block: what FSDP2 and ZeRO-3 gather at a time."""
        return self.shape.block_params / self.shape.layers

    @property
    def shard(self) -> float:
        """Parameters whose optimizer state this rank owns under sharding."""
        return self.shape.params / self.ranks

    def host_adam(self) -> float:
        """Adam over this rank's shard on the host, on this rank's share of the cores."""
        return self.shard / (_HOST_ADAM_PARAMS_PER_CORE_S * self.host_cores)

    @property
    def fsdp_link(self) -> float:
        """Bytes/s of FSDP2's offload copies, one direction."""
        return self.host_link * _FSDP_COPY_EFFICIENCY

    @property
    def deepspeed_link(self) -> float:
        """Bytes/s of DeepSpeed's per-parameter offload copies, one direction."""
        return self.host_link * _DEEPSPEED_COPY_EFFICIENCY


_Result = tuple[_Exposed, _Exposed, float]
"""Exposed time of the boundary micro-step, of an accumulation micro-step; optimizer step."""


def _adapters(shape: _Shape, config: TrainConfig) -> float:
    """LoRA's adapter parameters on one rank (``ModelSpec.lora_params``); 0 without LoRA."""
    return float(config.lora_rank * shape.linear_features * shape.layers)


def _lora_kind(config: TrainConfig) -> str:
    """Which of LoRA's measured cases a configuration is: ``fp32``, ``mixed`` (autocast over
    16-bit frozen weights) or ``bf16``."""
    if config.precision is Precision.FP32:
        return "fp32"
    return "mixed" if config.precision.is_mixed else "bf16"


def _ddp(step: _Step) -> _Result:
    """DDP: bucketed gradient all-reduce overlapped with the backward; Adam on the full model
    (under LoRA, on the fp32 adapters alone, whose gradients alone are reduced)."""
    config, psi = step.config, float(step.shape.params)
    grad_bytes = 2.0 if config.precision is Precision.BF16 else 4.0  # gradients in param dtype
    if config.is_lora:
        psi, grad_bytes = _adapters(step.shape, config), 4.0
    total = psi * grad_bytes
    buckets = max(1, math.ceil(total / _DDP_BUCKET_BYTES))
    per_bucket = _collective(step.fabric, "ar", total / buckets)
    exposed = _exposed(buckets * per_bucket, buckets, step.work.backward, per_bucket)
    return _Exposed(exposed, 0.0), _Exposed(0.0, 0.0), psi * step.adam_s_per_param


def _fsdp(step: _Step) -> _Result:
    """FSDP2: per-block all-gather of 16-bit parameters (again in the backward for ZeRO-3) and
    reduce-scatter of gradients (fp32 under bf16-mixed: reduce_dtype), prefetched one block
    ahead; CPUOffloadPolicy uploads the fp32 shard for each gather, downloads the gradient
    shard and steps Adam on the host."""
    config, work, fabric, layers = step.config, step.work, step.fabric, step.shape.layers
    pure = config.precision is Precision.BF16
    param_bytes = float(config.precision.compute_bytes)
    grad_bytes = 2.0 if pure else 4.0
    shard_bytes = 2.0 if pure else 4.0
    block, root, n = step.block, step.root, step.ranks
    gather = _collective(fabric, "ag", block * param_bytes)
    gather_root = _collective(fabric, "ag", root * param_bytes)
    reduce = _collective(fabric, "rs", block * grad_bytes)
    reduce_root = _collective(fabric, "rs", root * grad_bytes)
    offloaded = config.offload is Offload.PARAMS
    link = step.fsdp_link
    up = block / n * shard_bytes / link if offloaded else 0.0
    up_root = root / n * shard_bytes / link if offloaded else 0.0
    down = block / n * grad_bytes / link if offloaded else 0.0
    down_root = root / n * grad_bytes / link if offloaded else 0.0
    regather = config.zero_stage == 3

    def exposed(pcie: bool, reduce_grads: bool) -> float:
        u, ur = (up, up_root) if pcie else (0.0, 0.0)
        dn, dr = (down, down_root) if pcie else (0.0, 0.0)
        fwd = gather_root + ur + _exposed(layers * (gather + u), layers, work.forward, gather + u)
        per_block = (gather + u if regather else 0.0) + (reduce + dn if reduce_grads else 0.0)
        bwd = _exposed(layers * per_block, layers, work.backward, per_block)
        return fwd + bwd + (reduce_root + dr if reduce_grads else 0.0)

    sync = _split(exposed(True, True), exposed(False, True))
    accumulate = _split(exposed(True, False), exposed(False, False))
    optimizer = step.host_adam() if offloaded else step.shard * step.adam_s_per_param
    return sync, accumulate, optimizer + layers * _FSDP_STEP_HOST_PER_LAYER_S


def _deepspeed(step: _Step) -> _Result:
    """DeepSpeed ZeRO stages 0-3 as the probe configures them (deepspeed_config): overlapped
    communication, buckets of d² elements, 16-bit communication, CPU Adam for offload."""
    config, work, fabric, layers = step.config, step.work, step.fabric, step.shape.layers
    psi, shard, n, link = float(step.shape.params), step.shard, step.ranks, step.deepspeed_link
    comm_bytes = float(config.precision.compute_bytes)
    bucket = float(step.shape.hidden**2)  # reduce_bucket_size = allgather_bucket_size = d²
    buckets = max(1, math.ceil(psi / bucket))
    cpu_adam = config.offload is not Offload.NONE
    # The rank's gradient partition, converted to fp32 on the GPU, down; the updated fp32
    # partition up after the host step.  Neither overlaps the pass (see _DEEPSPEED_COPY_...).
    grads_down = shard * 4.0 / link if cpu_adam else 0.0
    params_up = shard * 4.0 / link if cpu_adam else 0.0
    stage = config.zero_stage
    none = _Exposed(0.0, 0.0)

    if stage == 0:
        # The whole gradient is all-reduced after the backward (buffered_allreduce_fallback).
        reduce_all = _collective(fabric, "ar", psi * comm_bytes)
        return _Exposed(reduce_all, 0.0), none, psi * step.adam_s_per_param

    if stage in (1, 2):
        # Each filled bucket is all-reduced during the backward (DeepSpeed 0.19's default
        # use_multi_rank_bucket_allreduce) and each rank keeps its slice, copied to the host
        # under offload.  ZeRO-1 reduces at the boundary only.
        per_bucket = _collective(fabric, "ar", bucket * comm_bytes)
        reduced = _exposed(buckets * per_bucket, buckets, work.backward, per_bucket)
        sync = _Exposed(reduced, grads_down)
        calls = max(1, math.ceil(shard / bucket))
        gather = _collective(fabric, "ag", psi * comm_bytes, calls=calls)
        if cpu_adam:
            optimizer = step.host_adam() + params_up + gather
        else:
            optimizer = shard * step.adam_s_per_param + gather
        return sync, sync if stage == 2 else none, optimizer

    # ZeRO-3: each module's partitions are gathered before it runs, forward and backward,
    # prefetched a bucket (0.9·d² elements) ahead; gradients are reduce-scattered in buckets
    # as the backward produces them (and copied down under offload, after the pipeline);
    # parameter offload uploads each 16-bit partition before its gather.
    block, root = step.block, step.root
    calls = max(1, math.ceil(block / (0.9 * bucket)))
    gather = _collective(fabric, "ag", block * comm_bytes, calls=calls)
    gather_root = _collective(fabric, "ag", root * comm_bytes)
    per_bucket = _collective(fabric, "rs", bucket * comm_bytes)
    params_off = config.offload is Offload.PARAMS
    up = block / n * comm_bytes / link if params_off else 0.0
    up_root = root / n * comm_bytes / link if params_off else 0.0

    def zero3(pcie: bool) -> float:
        u, ur = (up, up_root) if pcie else (0.0, 0.0)
        fwd = gather_root + ur + _exposed(layers * (gather + u), layers, work.forward, gather + u)
        comm = layers * (gather + u) + buckets * per_bucket + gather_root + ur
        return fwd + _exposed(comm, layers, work.backward, gather + u + per_bucket)

    without = zero3(False)
    sync = _Exposed(without, zero3(True) - without + grads_down)
    if not cpu_adam:
        optimizer = shard * step.adam_s_per_param
    else:
        # Host Adam, ZeRO-3's other host work over the partition, and the upload (none with
        # parameter offload: the host copy is the one the next gathers upload).
        host_cores = _ZERO3_HOST_STEP_PARAMS_PER_CORE_S * step.host_cores
        optimizer = step.host_adam() + shard / host_cores + (0.0 if params_off else params_up)
    return sync, sync, optimizer


def predict_step_time(
    model: ModelSpec,
    config: TrainConfig,
    gpu: GpuSpec,
    *,
    micro_batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    world_size: int = 1,
    gpus_per_node: int = 8,
    host_cores: int | None = None,
    token_share: float = 1.0,
    sequence_share: float = 1.0,
) -> StepTime:
    """Predict the micro-step and optimizer-step time of a configuration on ``world_size`` GPUs.

    Args:
        model: The model shape.
        config: Engine, sharding, precision, checkpointing, offload and attention kernel.
        gpu: The GPU every rank has (``autotune.hardware.gpu_spec``).
        micro_batch_size: Sequences per micro-step per rank.
        seq_len: Tokens per sequence.
        grad_accum: Micro-steps per optimizer step.
        world_size: Data-parallel ranks, all GPUs together.
        gpus_per_node: GPUs per node; collectives over more ranks cross the network.
        host_cores: CPU cores of each node, which host Adam under offload runs on, shared
            evenly by the node's ranks; None for 16 per GPU.
        token_share: The share of each micro-step's tokens this rank computes, attention
            still spanning ``seq_len`` keys: ``1 / cp`` where context parallelism splits the
            sequence (:mod:`autotune.estimator.parallel`).
        sequence_share: The share of those tokens whose residual-stream operators (norms,
            residual adds: the d-wide element-wise work) this rank runs: ``1 / tp`` under
            sequence parallelism, where the model is a TP rank's shard.

    Returns:
        The predicted times, throughput and MFU.

    Raises:
        ValueError: For a non-positive size, the single engine on more than one rank, or a
            precision the GPU has no fast path for (bf16 on V100).
    """
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("seq_len", seq_len),
        ("grad_accum", grad_accum),
        ("world_size", world_size),
        ("gpus_per_node", gpus_per_node),
        ("host_cores", 1 if host_cores is None else host_cores),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if config.engine is Engine.SINGLE and world_size != 1:
        raise ValueError(f"engine single runs one process, not world_size {world_size}")
    dtype = config.precision.compute_dtype  # fp32 is full fp32: the probes leave tf32 off
    peak = gpu.peak(dtype)
    if peak is None:
        raise ValueError(
            f"{gpu.name} has no {dtype} tensor-core path: use --precision fp16-mixed "
            "(or fp32) on this GPU"
        )

    shape = _shape(model)
    arch = _architecture(gpu)
    layers = shape.layers
    fraction = 0.0 if config.ac_every <= 0 else len(range(0, layers, config.ac_every)) / layers
    for name, share in (("token_share", token_share), ("sequence_share", sequence_share)):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {share}")
    tokens = micro_batch_size * seq_len
    local = tokens * token_share
    work = _compute(shape, config, gpu, arch, peak, local, seq_len, fraction, sequence_share)
    compute_s = work.forward + work.backward

    ranks_on_node = min(world_size, gpus_per_node)
    step = _Step(
        shape=shape,
        config=config,
        work=work,
        fabric=_fabric(gpu, arch, world_size, gpus_per_node),
        host_link=gpu.host_link_bandwidth,
        adam_s_per_param=_gpu_adam_bytes(config) / (gpu.hbm_bandwidth * _ADAM_HBM_EFFICIENCY),
        host_cores=(_HOST_CORES_PER_GPU if host_cores is None else host_cores / ranks_on_node),
    )
    if config.engine is Engine.FSDP:
        sync, accumulate, optimizer_s = _fsdp(step)
    elif config.engine is Engine.DEEPSPEED:
        sync, accumulate, optimizer_s = _deepspeed(step)
    else:
        sync, accumulate, optimizer_s = _ddp(step)
    if config.optimizer is Optimizer.ADAMW_8BIT:
        optimizer_s = max(optimizer_s, shape.tensors * _COMPILED_STEP_CALL_S)
    if config.act_offload:
        # Each saved tensor crosses the host link out in the forward (a synchronous copy) and
        # back in the backward (on the compute stream): neither hides behind compute.
        moved = offloaded_activation_bytes(
            model, config, tokens, activation_profile(model, config, seq_len)
        )
        copies = 2.0 * moved / (step.host_link * _ACTIVATION_COPY_EFFICIENCY)
        sync = _Exposed(sync.communication, sync.offload + copies)
        accumulate = _Exposed(accumulate.communication, accumulate.offload + copies)

    micro_step_s = compute_s + sync.communication + sync.offload
    accumulation_s = compute_s + accumulate.communication + accumulate.offload
    step_s = grad_accum * micro_step_s + optimizer_s
    exact_step_s = (grad_accum - 1) * accumulation_s + micro_step_s + optimizer_s
    tokens_per_second = tokens * grad_accum * world_size / step_s
    # metrics.throughput's FLOPs: ModelSpec.flops_per_token and hardware_flops_per_token.
    model_flops = model.flops_per_token(seq_len, lora_rank=config.lora_rank)
    hardware_flops = model.hardware_flops_per_token(seq_len, fraction, lora_rank=config.lora_rank)
    if config.loss is Loss.CHUNKED:
        hardware_flops += 2.0 * shape.hidden * shape.vocab  # the logits, made again
    per_rank = tokens_per_second / world_size
    return StepTime(
        compute_s=compute_s,
        communication_s=sync.communication,
        offload_s=sync.offload,
        micro_step_s=micro_step_s,
        accumulation_micro_step_s=accumulation_s,
        optimizer_step_s=optimizer_s,
        step_s=step_s,
        exact_step_s=exact_step_s,
        tokens_per_second=tokens_per_second,
        mfu=per_rank * model_flops / peak,
        hfu=per_rank * hardware_flops / peak,
    )

"""Host memory a configuration needs per node: offloaded states and each rank's process.

CPU offload moves model states to the host, where the first GPU run (one H100, 125 GiB of
host RAM, measurements/h100-2026-11-23) showed them to be the binding limit: three of four
llama-7b probes were killed by the kernel's OOM killer while building their states. A rank
needs:

- **a process baseline**: the interpreter, torch, the CUDA context and libraries. Measured as
  the peak RSS of probes that offload nothing: 1.4-1.5 GiB (single), 1.8 GiB (FSDP2, which
  loads torch.distributed and NCCL; DeepSpeed is taken to be the same).
- **the offloaded states**, sharded over the data-parallel ranks like on the device. Offload
  keeps fp32 master weights, fp32 gradients and the two Adam moments on the host (16 bytes a
  parameter, Rajbhandari et al. 2020, "ZeRO", section 3.1; Ren et al. 2021, "ZeRO-Offload"),
  and DeepSpeed's parameter offload adds the 16-bit weights (2 bytes a parameter).
- **the rounding of pinned memory**: page-locked host memory comes from PyTorch's caching
  host allocator, which rounds every block up to a power of two. So the cost of a pinned
  buffer depends on how the states are cut:

  - DeepSpeed ZeRO-1/2 keeps one flat fp32 partition per parameter group, ZeRO-3 one per
    sub-group of ``sub_group_size`` (1e9) parameters: each is rounded whole (a 1.5B model's
    6.2 GB partition takes 8 GiB). All four state buffers round alike.
  - FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` pins each sharded parameter, and each
    gradient arrives by a non-blocking copy into pinned memory: tensor by tensor rounding of
    8 of the 16 bytes; the Adam moments are plain memory.

The baselines are measured, the states follow from the three mechanisms above (written after
the H100 run's probes showed the rounded sizes), and the node's reserve was chosen so that
run's 118 GiB probe fits: the figures below are in-sample (docs/estimator.md has the
left-out ones). They predict the peak RSS of every probe of the H100 run within 9 %
(``tests/estimator/test_host.py``; docs/estimator.md has the table): FSDP2 parameter
offload 27.8 GiB predicted vs 27.8 measured (qwen2.5-1.5b) and 118.0 vs 118.0 (llama-7b);
DeepSpeed optimizer offload 33.8 vs 34.0 (ZeRO-2) and 33.2 (ZeRO-3); DeepSpeed ZeRO-3
parameter offload 37.4 vs 39.4, the one under-prediction (5 %). The three llama-7b DeepSpeed
probes that the OOM killer stopped are predicted at 129.8-130.3 GiB, over the 121 GiB usable
of that 125 GiB node.
On a CPU device nothing is pinned and the device's own tensors are host memory too.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Engine, Offload, TrainConfig
from autotune.models import ModelSpec
from autotune.units import GIB

__all__ = [
    "CUDA_RANK_BASELINE_BYTES",
    "HOST_RESERVE_BYTES",
    "HostEstimate",
    "estimate_host",
    "usable_host_bytes",
]

CUDA_RANK_BASELINE_BYTES = {
    Engine.SINGLE: int(1.5 * GIB),
    Engine.DDP: int(1.8 * GIB),
    Engine.FSDP: int(1.8 * GIB),
    Engine.DEEPSPEED: int(1.8 * GIB),
}
"""Peak RSS of a rank that offloads nothing, on a GPU: interpreter, torch, CUDA context and
libraries (H100 run, torch 2.11+cu130: single 1.4-1.5 GiB, FSDP2 1.8 GiB; DDP and DeepSpeed,
not measured, are taken to be FSDP2's)."""
CPU_RANK_BASELINE_BYTES = {
    Engine.SINGLE: int(0.55 * GIB),
    Engine.DDP: int(0.9 * GIB),
    Engine.FSDP: int(0.9 * GIB),
    Engine.DEEPSPEED: int(0.9 * GIB),
}
"""The same on the CPU device (no CUDA context): peak RSS beyond the tensors the probe counts,
gpt2 on this project's 2-core test machine (torch 2.13+cpu): single 0.54 GiB, FSDP2 0.86-1.1
GiB (with or without parameter offload)."""
HOST_RESERVE_BYTES = 4 * GIB
"""Host memory kept for the kernel, the tuner itself and page cache under pressure. The H100
node (125 GiB) ran an FSDP2 probe at 118 GiB of peak RSS; 4 GiB keeps that within the limit."""
PINNED_ACTIVATION_BOUND = 2.0
"""Activation offload pins each saved tensor's host copy, which the caching host allocator
rounds up to a power of two: the host model takes the bound (2x: a host OOM takes the node),
not measured on a GPU yet. On the CPU the emulated host pool is counted exactly."""
DEEPSPEED_SUB_GROUP = 1_000_000_000
"""DeepSpeed ZeRO-3's ``sub_group_size`` default: parameters per flat optimizer partition."""
_STATE_BYTES = 16.0
"""fp32 master weights, fp32 gradients, Adam's two fp32 moments, per parameter."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostEstimate:
    """Predicted peak host memory of one node, and its parts."""

    per_rank_bytes: int
    """One rank: its baseline and its share of the offloaded states."""
    states_bytes: int
    """Offloaded states (and activations) of one rank, pinned buffers at their rounded size."""
    ranks_per_node: int

    @property
    def node_bytes(self) -> int:
        """What the node's ranks need together (what the OOM killer judges)."""
        return self.per_rank_bytes * self.ranks_per_node


def usable_host_bytes(host_bytes: int, *, reserve: int = HOST_RESERVE_BYTES) -> int:
    """Host memory a node's ranks may take: what the job may use, less the reserve."""
    return max(0, host_bytes - reserve)


def _pow2(size: float) -> int:
    """The caching host allocator's block for ``size`` bytes: the next power of two."""
    size = int(size)
    return 1 << (size - 1).bit_length() if size > 1 else size


def _matrices(model: ModelSpec) -> list[int]:
    """Elements of each weight matrix (tables, projections, head); norms and biases, under
    0.1 % of the bytes, are left to the remainder."""
    d, inter, vocab = model.hidden_size, model.intermediate_size, model.vocab_size
    q_dim = model.num_attention_heads * model.head_dim
    kv_dim = model.num_key_value_heads * model.head_dim
    if model.model_type == "gpt2":
        block = [3 * d * d, d * d, d * inter, inter * d]
        outside = [vocab * d, model.max_position_embeddings * d]
    else:
        block = [d * q_dim, d * kv_dim, d * kv_dim, q_dim * d, d * inter, d * inter, inter * d]
        outside = [vocab * d]
    if not model.tie_word_embeddings:
        outside.append(vocab * d)
    return outside + block * model.num_layers


def _per_tensor(model: ModelSpec, bytes_per_param: float, shards: int) -> float:
    """Pinned tensor by tensor, each sharded ``shards`` ways and rounded up."""
    matrices = _matrices(model)
    rest = max(0, model.num_params - sum(matrices))
    return sum(_pow2(bytes_per_param * n / shards) for n in matrices) + (
        bytes_per_param * rest / shards
    )


def _flat(elements: float, bytes_per_param: float, group: float | None = None) -> float:
    """Pinned as flat partitions of ``group`` elements (one when None), each rounded up."""
    if group is None or elements <= group:
        return _pow2(bytes_per_param * elements)
    full, rest = divmod(elements, group)
    return full * _pow2(bytes_per_param * group) + (_pow2(bytes_per_param * rest) if rest else 0)


def _states(model: ModelSpec, config: TrainConfig, world_size: int, pinned: bool) -> float:
    """Offloaded state bytes of one rank."""
    n, P = world_size, float(model.num_params)
    if config.offload is Offload.NONE or config.engine in (Engine.SINGLE, Engine.DDP):
        return 0.0
    if not pinned:
        weights = 2.0 * P / n if _deepspeed_params(config) else 0.0
        return _STATE_BYTES * P / n + weights
    if config.engine is Engine.FSDP:
        # Sharded fp32 parameters and gradients pinned tensor by tensor; moments plain.
        return _per_tensor(model, 8.0, n) + 8.0 * P / n
    group = DEEPSPEED_SUB_GROUP if config.zero_stage == 3 else None
    states = _flat(P / n, _STATE_BYTES, group)
    if _deepspeed_params(config):
        states += _per_tensor(model, 2.0, n)
    return states


def _deepspeed_params(config: TrainConfig) -> bool:
    return config.engine is Engine.DEEPSPEED and config.offload is Offload.PARAMS


def estimate_host(
    model: ModelSpec,
    config: TrainConfig,
    *,
    world_size: int = 1,
    ranks_per_node: int | None = None,
    device: str = "cuda",
    device_bytes: int = 0,
    activation_bytes: int = 0,
) -> HostEstimate:
    """Peak host memory of one node of ranks training ``config``.

    Args:
        model: The model shape.
        config: The configuration.
        world_size: Data-parallel ranks the states are sharded over.
        ranks_per_node: Ranks sharing the node's memory (default: all of them).
        device: ``cuda`` (offloaded buffers pinned) or ``cpu`` (nothing pinned, and the
            device's tensors are host memory).
        device_bytes: A rank's peak device bytes, counted on the host when ``device`` is cpu.
        activation_bytes: A rank's offloaded activations
            (``MemoryEstimate.offloaded_activation_bytes``), pinned tensor by tensor on a GPU:
            counted at :data:`PINNED_ACTIVATION_BOUND` times.
    """
    pinned = device != "cpu"
    states = _states(model, config, world_size, pinned)
    states += activation_bytes * (PINNED_ACTIVATION_BOUND if pinned else 1.0)
    baselines = CUDA_RANK_BASELINE_BYTES if pinned else CPU_RANK_BASELINE_BYTES
    baseline = baselines[config.engine]
    # On the CPU the device's tensors are host memory too.
    per_rank = baseline + states + (0 if pinned else device_bytes)
    return HostEstimate(
        per_rank_bytes=int(per_rank),
        states_bytes=int(states),
        ranks_per_node=ranks_per_node or world_size,
    )

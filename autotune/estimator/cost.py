"""What a probe costs in wall-clock time, before it runs: start-up, building the model's states
(on the device, and offloaded ones on the host), then each micro-batch size's steps.

The simulated device charges its probes this time, and the controller uses it to decide
whether the next probe still fits in the budget (scaled by how long the run's probes took
against their predictions). The figures come from the first GPU run (one H100, 16 cores,
measurements/h100-2026-11-23): every probe's ``import_s``, ``build_s`` and step times.
"""

from __future__ import annotations

from collections.abc import Iterable

from autotune.config import Engine, TrainConfig
from autotune.estimator.host import estimate_host
from autotune.models import ModelSpec

__all__ = [
    "DEVICE_BUILD_BYTES_PER_S",
    "HOST_BUILD_BYTES_PER_S",
    "OOM_S",
    "START_S",
    "build_seconds",
    "probe_seconds",
]

START_S = 20.0
"""Start-up of a probe before its model is built: interpreter, torch, transformers and
DeepSpeed imports, the process group. The H100 run: 12-22 s of imports per probe."""
OOM_S = 5.0
"""A micro-batch size that runs out of device memory: its first step, the error, the cleanup."""
DEVICE_BUILD_BYTES_PER_S = 20e9
"""Building and initializing states on the device, bytes per second (the H100 run built
qwen2.5-1.5b's 25 GB of single-GPU states in 0.3-0.7 s: well above this, which leaves room
for the weight initialization of larger models)."""
HOST_BUILD_BYTES_PER_S = 1.75e9
"""Building offloaded states on the host (pinned allocation, initialization), bytes per
second: the H100 run took 18.4 s for FSDP2's 27.8 GiB (qwen2.5-1.5b), 63 s for 118 GiB
(llama-7b), 26 s for DeepSpeed ZeRO-3 optimizer offload's 33 GiB: 1.4-2.0 GB/s."""


def _device_states_bytes(model: ModelSpec, config: TrainConfig, world_size: int) -> float:
    """Bytes of model states one rank builds on its device (16 a parameter, sharded by the
    engines that shard)."""
    shards = world_size if config.engine not in (Engine.SINGLE, Engine.DDP) else 1
    return 16.0 * model.num_params / shards


def build_seconds(
    model: ModelSpec, config: TrainConfig, *, world_size: int, ranks_per_node: int
) -> float:
    """Time to build a probe's model and its states, on the device and on the host."""
    host = estimate_host(model, config, world_size=world_size, ranks_per_node=ranks_per_node)
    return (
        _device_states_bytes(model, config, world_size) / DEVICE_BUILD_BYTES_PER_S
        + host.states_bytes / HOST_BUILD_BYTES_PER_S
    )


def probe_seconds(*, build_s: float, step_seconds: Iterable[float | None], steps: int) -> float:
    """A probe's wall time: start-up, build, then ``steps`` steps of each size (None: a size
    that runs out of memory)."""
    return START_S + build_s + sum(OOM_S if step is None else step * steps for step in step_seconds)

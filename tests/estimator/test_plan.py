"""The planner, the search space and the simulated device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from autotune.config import ConfigError, Engine, TrainConfig
from autotune.estimator.plan import plan, usable_bytes
from autotune.estimator.simulate import SimulatedDevice
from autotune.hardware import gpu_spec
from autotune.models import preset_names, resolve_model
from autotune.probe import Outcome, ProbeResult, ProbeSpec
from autotune.space import Workload, configurations, ladder_key, micro_batch_options


def test_workload_keeps_the_global_batch_exact() -> None:
    work = Workload(seq_len=4096, global_batch=512, world_size=8)
    assert micro_batch_options(work) == [1, 2, 4, 8, 16, 32, 64]
    assert all(m * 8 * work.grad_accum(m) == 512 for m in micro_batch_options(work))
    with pytest.raises(ConfigError, match="multiple of 8 GPUs"):
        Workload(seq_len=2048, global_batch=100, world_size=8)
    with pytest.raises(ConfigError, match="divisor"):
        work.grad_accum(3)


def test_space_is_valid_and_in_ladder_order() -> None:
    one = configurations(world_size=1, num_layers=32)
    eight = configurations(world_size=8, num_layers=32)
    assert all(c.engine is not Engine.DDP for c in one)  # nothing to replicate on one GPU
    assert {c.engine for c in eight} == {Engine.DDP, Engine.FSDP, Engine.DEEPSPEED}
    assert eight == sorted(eight, key=ladder_key)
    assert eight[0].zero_stage == 0 and eight[0].ac_every == 0  # the cheapest rung first
    assert len(set(eight)) == len(eight)
    only = configurations(world_size=8, num_layers=32, engines=[Engine.FSDP])
    assert only and all(c.engine is Engine.FSDP for c in only)


def test_plan_ranks_fitting_configurations_by_throughput() -> None:
    rows = plan(
        resolve_model("llama-7b"),
        gpu_spec("h100-80gb"),
        Workload(seq_len=4096, global_batch=512, world_size=8),
    )
    fitting = [r for r in rows if r.fits]
    missing = [r for r in rows if not r.fits]
    assert fitting and missing
    assert rows[: len(fitting)] == fitting  # fitting first
    speeds = [r.tokens_per_second for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.memory.peak_bytes <= r.capacity_bytes for r in fitting)
    assert all(r.over_bytes > 0 and r.time is None for r in missing)
    # DDP replicates 20 bytes a parameter: 135 GB for llama-7b, more than an 80 GB GPU holds.
    assert all(r.config.engine is not Engine.DDP for r in fitting)
    best = fitting[0]
    assert best.micro_batch_size * 8 * best.grad_accum == 512
    assert 0.2 < (best.time.mfu or 0) < 0.7 if best.time else False


def test_plan_headroom_shrinks_what_fits() -> None:
    args = (
        resolve_model("llama-7b"),
        gpu_spec("a100-40gb"),
        Workload(seq_len=2048, global_batch=64, world_size=8),
    )
    loose = plan(*args)
    tight = plan(*args, headroom=0.3)
    assert sum(r.fits for r in tight) < sum(r.fits for r in loose)
    assert usable_bytes(gpu_spec("a100-40gb"), headroom=0.3) < loose[0].capacity_bytes


def test_plan_covers_every_preset_and_a_70b_model_on_64_gpus_quickly() -> None:
    for name in preset_names():
        rows = plan(
            resolve_model(name),
            gpu_spec("h100"),
            Workload(seq_len=2048, global_batch=64, world_size=8),
        )
        assert rows
    model = resolve_model("llama-70b")
    started = time.perf_counter()
    rows = plan(
        model, gpu_spec("h100-80gb"), Workload(seq_len=4096, global_batch=1024, world_size=64)
    )
    elapsed = time.perf_counter() - started
    print(f"llama-70b on 64 GPUs: {len(rows)} configurations planned in {elapsed * 1000:.0f} ms")
    assert any(r.fits for r in rows)


def _probe(tmp_path: Path, device: SimulatedDevice, **kwargs: object) -> ProbeResult:
    spec = ProbeSpec(**{"model": "llama-7b", "seq_len": 4096, "device": "cuda", **kwargs})  # type: ignore[arg-type]
    return device.launch_probe(spec, tmp_path / "probe")


def test_simulated_device_reports_like_a_probe_and_says_simulated(tmp_path: Path) -> None:
    device = SimulatedDevice.named("h100-80gb", seed=3)
    config = TrainConfig(engine="fsdp", zero_stage=3)
    result = _probe(
        tmp_path, device, config=config, micro_batch_sizes=(1, 2, 4, 8), num_processes=8
    )
    assert result.device == "simulated:h100-80gb" and "simulated" in (result.gpu_name or "")
    assert result.outcome is Outcome.OOM
    assert [s["outcome"] for s in result.sizes] == ["ok", "ok", "oom"]  # stops at the OOM
    assert all(s["simulated"] for s in result.sizes)
    assert "simulated out of memory" in result.message
    ok = result.ok_sizes()
    assert ok[1]["tokens_per_second"] > ok[0]["tokens_per_second"] > 0
    assert 0 < ok[0]["mfu"] < 1
    # Same files as a real probe, and the result reads back.
    assert (tmp_path / "probe" / "config.json").exists()
    again = ProbeResult.read(tmp_path / "probe")
    assert again.sizes == json.loads(json.dumps(result.sizes))


def test_simulated_noise_is_seeded(tmp_path: Path) -> None:
    def speed(seed: int, noise: float) -> float:
        device = SimulatedDevice.named("a100-80gb", seed=seed, noise=noise)
        result = _probe(tmp_path / str(seed), device, config=TrainConfig(), model="qwen2.5-1.5b")
        return float(result.sizes[0]["tokens_per_second"])

    assert speed(1, 0.02) == speed(1, 0.02)
    assert speed(1, 0.02) != speed(2, 0.02)
    assert speed(1, 0.0) == speed(2, 0.0)


def test_simulated_single_rank_recovers_after_an_oom(tmp_path: Path) -> None:
    device = SimulatedDevice.named("h100-80gb")
    result = _probe(
        tmp_path,
        device,
        model="qwen2.5-1.5b",
        config=TrainConfig(),
        micro_batch_sizes=(64, 1, 2),
        seq_len=1024,
        device_memory_bytes=40 * 1024**3,
    )
    assert [s["outcome"] for s in result.sizes] == ["oom", "ok", "ok"]
    assert result.sizes[0]["peak_allocated_bytes"] > 40 * 1024**3


def test_simulated_model_error_is_per_configuration_and_bounded(tmp_path: Path) -> None:
    exact = SimulatedDevice.named("h100-80gb", seed=5)
    biased = SimulatedDevice.named("h100-80gb", seed=5, model_error=0.1)
    configs = [TrainConfig(), TrainConfig(ac_every=1), TrainConfig(ac_every=2)]
    factors = [biased.bias("qwen2.5-1.5b", c) for c in configs]
    assert all(0.9 <= f <= 1.1 for pair in factors for f in pair)
    assert len(set(factors)) == len(configs)  # each configuration is off by its own factors
    assert exact.bias("qwen2.5-1.5b", configs[0]) == (1.0, 1.0)

    def reading(device: SimulatedDevice) -> tuple[float, float]:
        result = _probe(
            tmp_path / str(id(device)), device, model="qwen2.5-1.5b", config=configs[0],
            micro_batch_sizes=(1, 2), seq_len=1024,
        )  # fmt: skip
        return (
            result.sizes[1]["peak_allocated_bytes"] / result.sizes[0]["peak_allocated_bytes"],
            result.sizes[0]["peak_allocated_bytes"],
        )

    (ratio_exact, peak_exact), (ratio_biased, peak_biased) = reading(exact), reading(biased)
    memory_factor = factors[0][0]
    assert peak_biased == pytest.approx(peak_exact * memory_factor, rel=1e-6)
    assert ratio_biased == pytest.approx(ratio_exact, rel=1e-6)  # the same at every size

"""The simulated device: the estimator answering probes, with seeded noise and model error."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import TrainConfig
from autotune.devices import ErrorTerm, SimulatedDevice
from autotune.probe import Outcome, ProbeResult, ProbeSpec


def _probe(tmp_path: Path, device: SimulatedDevice, **kwargs: object) -> ProbeResult:
    spec = ProbeSpec(**{"model": "llama-7b", "seq_len": 4096, "device": "cuda", **kwargs})  # type: ignore[arg-type]
    return device.launch(spec, tmp_path / "probe")


def test_simulated_device_reports_like_a_probe_and_says_simulated(tmp_path: Path) -> None:
    device = SimulatedDevice.named("h100-80gb", seed=3)
    config = TrainConfig(engine="fsdp", zero_stage=3)
    result = _probe(
        tmp_path, device, config=config, micro_batch_sizes=(1, 2, 4, 8), num_processes=8
    )
    assert result.device == "simulated:h100-80gb" and "simulated" in (result.gpu_name or "")
    assert result.outcome is Outcome.OOM
    assert [s.outcome for s in result.sizes] == ["ok", "ok", "oom"]  # stops at the OOM
    assert all(s.simulated for s in result.sizes)
    assert "simulated out of memory" in result.message
    ok = result.ok_sizes()
    assert (ok[1].tokens_per_second or 0) > (ok[0].tokens_per_second or 0) > 0
    assert 0 < (ok[0].mfu or 0) < 1
    # Same files as a real probe, and the result reads back.
    assert (tmp_path / "probe" / "config.json").exists()
    again = ProbeResult.read(tmp_path / "probe")
    assert again.sizes == result.sizes


def test_simulated_noise_is_seeded(tmp_path: Path) -> None:
    def speed(seed: int, noise: float) -> float:
        device = SimulatedDevice.named("a100-80gb", seed=seed, noise=noise)
        result = _probe(tmp_path / str(seed), device, config=TrainConfig(), model="qwen2.5-1.5b")
        return float(result.sizes[0].tokens_per_second or 0)

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
    assert [s.outcome for s in result.sizes] == ["oom", "ok", "ok"]
    assert (result.sizes[0].peak_allocated_bytes or 0) > 40 * 1024**3


OWN = (ErrorTerm(time=(0.9, 1.1), memory=(0.9, 1.1)),)


def test_an_error_term_by_configuration_is_its_own_and_bounded(tmp_path: Path) -> None:
    exact = SimulatedDevice.named("h100-80gb", seed=5)
    biased = SimulatedDevice.named("h100-80gb", seed=5, errors=OWN)
    configs = [TrainConfig(), TrainConfig(ac_every=1), TrainConfig(ac_every=2)]
    factors = [biased.bias("qwen2.5-1.5b", c, 4) for c in configs]
    assert all(0.9 <= f <= 1.1 for pair in factors for f in pair)
    assert len(set(factors)) == len(configs)  # each configuration is off by its own factors
    assert exact.bias("qwen2.5-1.5b", configs[0], 4) == (1.0, 1.0)
    assert biased.bias("qwen2.5-1.5b", configs[0], 1) == factors[0]  # the same at every size

    def reading(device: SimulatedDevice) -> tuple[float, float]:
        result = _probe(
            tmp_path / str(id(device)), device, model="qwen2.5-1.5b", config=configs[0],
            micro_batch_sizes=(1, 2), seq_len=1024,
        )  # fmt: skip
        small, large = (s.peak_allocated_bytes or 0 for s in result.sizes)
        return large / small, small

    (ratio_exact, peak_exact), (ratio_biased, peak_biased) = reading(exact), reading(biased)
    memory_factor = factors[0][0]
    assert peak_biased == pytest.approx(peak_exact * memory_factor, rel=1e-6)
    assert ratio_biased == pytest.approx(ratio_exact, rel=1e-6)  # the same at every size


FAMILY = (
    ErrorTerm(time=(0.98, 1.02)),
    ErrorTerm(by=("engine",), time=(0.8, 1.2), only="no-offload"),
    ErrorTerm(by=("engine", "offload"), time=(1.4, 2.0), only="offload"),
)


def test_an_error_term_by_engine_and_offload_is_shared_within_the_family() -> None:
    device = SimulatedDevice.named("h100-80gb", seed=3, errors=FAMILY)
    offload = [
        TrainConfig(engine="deepspeed", zero_stage=z, offload="optimizer", ac_every=ac)
        for z in (1, 2, 3)
        for ac in (0, 1)
    ]
    times = [device.bias("llama-7b", c, 1)[1] for c in offload]
    assert all(1.4 * 0.98 <= t <= 2.0 * 1.02 for t in times)
    assert max(times) / min(times) <= (1.02 / 0.98) ** 1  # one family factor, per-config jitter
    singles = [device.bias("llama-7b", TrainConfig(ac_every=ac), 1)[1] for ac in (0, 1, 2, 4)]
    assert all(0.8 * 0.98 <= t <= 1.2 * 1.02 for t in singles)
    assert max(singles) / min(singles) <= 1.02 / 0.98
    other_seed = SimulatedDevice.named("h100-80gb", seed=4, errors=FAMILY)
    assert other_seed.bias("llama-7b", offload[0], 1)[1] != times[0]


def test_memory_error_may_grow_with_the_micro_batch_and_throughput_may_fall_off_a_cliff() -> None:
    growing = ErrorTerm(memory_per_doubling=(0.05, 0.05), cliff=(1.25, 1.25), cliff_from=(8, 8))
    device = SimulatedDevice.named("h100-80gb", seed=1, errors=(growing,))
    factors = {mbs: device.bias("llama-7b", TrainConfig(), mbs) for mbs in (1, 2, 4, 8, 16)}
    assert [round(m, 6) for m, _ in factors.values()] == [round(1.05**k, 6) for k in range(5)]
    assert [t for _, t in factors.values()] == [1.0, 1.0, 1.0, 1.25, 1.25]


def test_a_heavy_tailed_term_puts_its_share_of_configurations_far_off_either_way() -> None:
    """``tail_share`` of the configurations are 1.5-3x faster or slower, the rest within the
    term's own range; a term without a tail draws what it drew before the tail existed."""
    configs = [
        TrainConfig(engine=e, zero_stage=z, ac_every=ac)
        for e, z in (("single", 0), ("ddp", 0), ("fsdp", 2), ("fsdp", 3), ("deepspeed", 1))
        for ac in (0, 1, 2, 4)
    ]
    tailed = ErrorTerm(time=(0.95, 1.05), tail=(1.5, 3.0), tail_share=0.25)
    device = SimulatedDevice.named("h100-80gb", seed=7, errors=(tailed,))
    times = [device.bias("llama-7b", c, 2)[1] for c in configs]
    far = [t for t in times if not 0.95 <= t <= 1.05]
    assert all(0.95 / 3.0 <= t <= 0.95 / 1.5 or 1.5 * 0.95 <= t <= 3.0 * 1.05 for t in far)
    assert 1 <= len(far) <= len(configs) // 2  # 5 expected of 20
    plain = SimulatedDevice.named("h100-80gb", seed=7, errors=(ErrorTerm(time=(0.95, 1.05)),))
    near = [t for t in times if 0.95 <= t <= 1.05]
    assert near and set(near) <= {plain.bias("llama-7b", c, 2)[1] for c in configs}
    with pytest.raises(ValueError, match=r"share in 0\.\.1"):
        ErrorTerm(tail=(1.5, 3.0), tail_share=1.5)


def test_an_error_term_says_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="use engine"):
        ErrorTerm(by=("layers",))
    with pytest.raises(ValueError, match="not known"):
        ErrorTerm.from_dict({"by": ["engine"], "slope": [1, 2]})
    term = ErrorTerm.from_dict({"by": ["engine", "ac_every"], "time": [0.8, 1.6]})
    assert term.by == ("engine", "ac_every") and term.time == (0.8, 1.6)


@pytest.mark.parametrize("seed", range(8))
def test_a_knob_shares_its_twins_error_and_is_never_faster(seed: int) -> None:
    """Per-configuration errors of a configuration with the chunked loss, op-level
    checkpointing, 8-bit AdamW or activation offload are its twin's (the same kernels run),
    times the knob's own: memory within 2 %, time up to 3 % slower and never faster (a knob
    only adds work to its twin's step); the host factor is the twin's; and a configuration
    without knobs draws what it drew when configurations had no such fields (the key leaves
    knobs that are off out)."""
    from autotune.devices.simulated import _draw

    term = ErrorTerm(time=(0.5, 1.5), memory=(0.5, 1.5), host=(0.5, 1.5))
    device = SimulatedDevice.named("h100-80gb", seed=seed, errors=(term,))
    twin = TrainConfig(engine="fsdp", zero_stage=3)
    for knob in (
        {"loss": "chunked"},
        {"ac_ops": True},
        {"loss": "chunked", "ac_ops": True},
        {"optimizer": "adamw-8bit"},
        {"act_offload": True},
    ):
        config = TrainConfig(engine="fsdp", zero_stage=3, **knob)  # type: ignore[arg-type]
        (m0, t0), (m1, t1) = device.bias("llama-7b", twin, 4), device.bias("llama-7b", config, 4)
        assert 0.98 <= m1 / m0 <= 1.02 and 1.0 <= t1 / t0 <= 1.03
        assert device.host_factor("llama-7b", config) == device.host_factor("llama-7b", twin)
    plain, lora = TrainConfig(), TrainConfig(lora_rank=16)  # LoRA: its plain twin's error too
    (m0, t0), (m1, t1) = device.bias("llama-7b", plain, 4), device.bias("llama-7b", lora, 4)
    assert 0.98 <= m1 / m0 <= 1.02 and 1.0 <= t1 / t0 <= 1.03
    old_key = sorted(
        (k, v)
        for k, v in twin.to_dict().items()
        if k not in ("loss", "ac_ops", "optimizer", "lora_rank", "act_offload", "torch_compile")
    )  # the fields a configuration had before the knobs
    rng = _draw("term", seed, 0, "llama-7b", old_key)
    assert device.bias("llama-7b", twin, 1) == (rng.uniform(0.5, 1.5), rng.uniform(0.5, 1.5))

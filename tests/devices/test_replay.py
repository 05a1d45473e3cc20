"""The replay device against the first H100 run (measurements/h100-2026-11-23): it answers
what was measured and nothing else, charges what the probes took, and the search replayed on
the recorded grid finds the grid's best.

That folder is a partial grid (qwen2.5-1.5b: the single-GPU families, a few sizes each; see
its README): points it did not record are errors, so the search test shows the search works
through holes without guessing, not how many probes a complete grid would take.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from h100 import FOLDER, HOST_MEMORY_BYTES, probes

from autotune.api import prepare
from autotune.config import ConfigError, Engine, Offload, TrainConfig
from autotune.devices import ProbeClock, ReplayDevice
from autotune.devices.replay import GridKey
from autotune.probe import Outcome, ProbeResult
from autotune.probe.spec import ProbeSpec

QWEN = GridKey("qwen2.5-1.5b", 2048, 1, 1, None)


@pytest.fixture(scope="module")
def device() -> ReplayDevice:
    return ReplayDevice.from_folder(FOLDER, host_memory_bytes=HOST_MEMORY_BYTES)


def test_the_grid_is_the_workload_most_recorded_and_skips_what_is_not_a_probe(
    device: ReplayDevice,
) -> None:
    grid = device.grid
    assert grid.key == QWEN
    assert grid.gpu.key == "h100-80gb"
    # The qwen2.5-1.5b probes of the full device that ended ok, oom or host_oom: not the
    # 40 GiB-capped one (another workload), not DeepSpeed's failed build, not llama-7b's.
    expected = {
        name
        for name, p in probes().items()
        if p.spec.model == "qwen2.5-1.5b"
        and p.spec.device_memory_bytes is None
        and p.outcome in (Outcome.OK, Outcome.OOM, Outcome.HOST_OOM)
    }
    assert {r.path.stem for r in grid.recordings} == expected
    assert len(expected) == 12


@pytest.mark.parametrize("name", ["c1-single-0", "grid-1", "qwen2.5-1.5b-run-0", "c1-fsdp-0"])
def test_a_recorded_probe_replays_as_it_was_measured(
    device: ReplayDevice, name: str, tmp_path: Path
) -> None:
    recorded = probes()[name]
    spec = recorded.spec
    # Each is the first recording of its points (files are read in name order).
    assert device.grid.recorded(spec.config, spec.micro_batch_sizes[0])[0].probe.spec == spec
    replayed = device.launch(spec, tmp_path / "probe")
    assert replayed.outcome is recorded.outcome
    assert [(s.micro_batch_size, s.outcome) for s in replayed.sizes] == [
        (s.micro_batch_size, s.outcome) for s in recorded.sizes
    ]
    for mine, theirs in zip(replayed.sizes, recorded.sizes, strict=True):
        assert mine.peak_bytes == theirs.peak_bytes
        if theirs.ok:
            assert mine.tokens_per_second == pytest.approx(theirs.tokens_per_second, rel=1e-9)
            assert mine.mfu == pytest.approx(theirs.mfu, rel=1e-9)
    # The same steps as recorded: the same wall time, charged to the budget.
    assert replayed.wall_s == pytest.approx(recorded.wall_s, rel=1e-9)
    assert replayed.device == "replay:h100-80gb"
    assert json.loads((tmp_path / "probe" / "result.json").read_text())["outcome"] == (
        recorded.outcome.value
    )


def test_throughput_is_recomputed_at_the_probes_accumulation(
    device: ReplayDevice, tmp_path: Path
) -> None:
    base = probes()["grid-3"].spec
    one = device.launch(base, tmp_path / "a").size(4)
    sixteen = device.launch(dataclasses.replace(base, grad_accum=16), tmp_path / "b").size(4)
    assert one is not None and sixteen is not None
    # The optimizer step is amortized over 16 micro-steps: faster, from the same recording.
    assert sixteen.tokens_per_second > one.tokens_per_second  # type: ignore[operator]
    assert sixteen.micro_step_s == one.micro_step_s


def test_what_was_not_measured_is_an_error_or_follows_from_a_recorded_oom(
    device: ReplayDevice, tmp_path: Path
) -> None:
    single = TrainConfig(engine=Engine.SINGLE)
    spec = ProbeSpec(model="qwen2.5-1.5b", config=single, seq_len=2048, device="cuda")
    # single ac:off ran out of memory at 8 (c1-single-0): 32 cannot fit either.
    above = device.launch(dataclasses.replace(spec, micro_batch_sizes=(4, 32)), tmp_path / "a")
    assert [s.outcome for s in above.sizes] == [Outcome.OK, Outcome.OOM]
    assert "as recorded at micro-batch 8" in above.sizes[1].message
    # fsdp z2 was never recorded: an error that names the point, no guess.
    fsdp = TrainConfig(engine=Engine.FSDP, zero_stage=2)
    missing = device.launch(dataclasses.replace(spec, config=fsdp), tmp_path / "b")
    assert missing.outcome is Outcome.ERROR and missing.sizes == []
    assert "not recorded in the grid: fsdp z2 ac:off at micro-batch 1" in missing.message
    assert missing.wall_s == pytest.approx(device.grid.start_s())
    with pytest.raises(ConfigError, match="not the probe's workload"):
        device.launch(dataclasses.replace(spec, seq_len=4096), tmp_path / "c")


def test_a_host_oom_is_replayed_for_every_size_and_repeats_take_other_recordings(
    tmp_path: Path,
) -> None:
    llama = ReplayDevice.from_folder(FOLDER, key=GridKey("llama-7b", 2048, 1, 1, None))
    z3 = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.PARAMS)
    spec = ProbeSpec(model="llama-7b", config=z3, micro_batch_sizes=(1, 2), device="cuda")
    killed = llama.launch(spec, tmp_path / "k")
    assert killed.outcome is Outcome.HOST_OOM and killed.sizes == []
    assert killed.wall_s == pytest.approx(probes()["llama-7b-run-0"].wall_s)
    # single ac:off at 4 was recorded three times (grid-3, c1-single-0, run-1): a re-measure
    # (seed n) takes the n-th, so replayed repeats scatter as the real probes did.
    qwen = ReplayDevice.from_folder(FOLDER)
    base = ProbeSpec(model="qwen2.5-1.5b", micro_batch_sizes=(4,), seq_len=2048, device="cuda")
    speeds = [qwen.launch(dataclasses.replace(base, seed=n), tmp_path / str(n)) for n in range(3)]
    values = [r.sizes[0].tokens_per_second for r in speeds]
    assert len(qwen.grid.recorded(base.config, 4)) == 3 and len(set(values)) == 3
    assert (
        ProbeResult.read(tmp_path / "1").sizes[0].extra["recorded"]
        != (ProbeResult.read(tmp_path / "0").sizes[0].extra["recorded"])
    )


def test_the_search_replayed_on_the_h100_grid_finds_its_best(
    device: ReplayDevice, tmp_path: Path
) -> None:
    """``autotune run`` as on the H100 (qwen2.5-1.5b, seq 2048, global batch 64), its probes
    answered by the recordings. What the replay decided, probe by probe: the first probe (the
    plan's best, single ac:off at 2 and 4) is answered from its recordings and is the grid's
    best point; every later probe is answered where the grid recorded each of its sizes, and
    otherwise refused with an error naming a point the grid never measured (never guessed);
    the search ends on the grid's best."""
    tuning = prepare(
        "qwen2.5-1.5b", budget="30m", seq_len=2048, global_batch=64, device=device,
        storage=f"sqlite:///{tmp_path}/study.db", trials_dir=tmp_path / "trials",
    )  # fmt: skip
    assert isinstance(tuning.device.clock(), ProbeClock)
    summary = tuning.run()
    best = device.grid.best(64)
    assert best is not None and summary.best is not None
    config, mbs, value = best
    assert (summary.best.config, summary.best.micro_batch_size) == (config, mbs)
    # Confirmed by a second measurement, which the replay answers from the point's next
    # recording: the mean of its recordings, within their 1 % of the first one.
    assert summary.best.repeats >= 2
    assert summary.best.value == pytest.approx(value, rel=0.01)
    assert "replay" in tuning.fingerprint.study_name
    results = sorted(
        (ProbeResult.read(p.parent) for p in (tmp_path / "trials").rglob("result.json")),
        key=lambda r: int(r.probe_dir.name),
    )
    answered = [r for r in results if r.outcome is not Outcome.ERROR]
    print(f"the recordings answered {len(answered)} of the search's {len(results)} probes")
    first = results[0]
    assert (first.spec.config, first.spec.micro_batch_sizes) == (config, (2, 4))
    assert [s.outcome for s in first.sizes] == [Outcome.OK, Outcome.OK]
    assert all("recorded" in s.extra for s in first.sizes)
    assert len(results) >= 3
    for result in results:
        spec = result.spec
        unrecorded = [m for m in spec.micro_batch_sizes if not device.grid.recorded(spec.config, m)]
        if unrecorded:
            assert result.outcome is Outcome.ERROR and not result.sizes
            assert result.message.startswith(
                f"not recorded in the grid: {spec.config.label()} at micro-batch {unrecorded[0]}"
            ), result.message
        else:
            assert result in answered and all("recorded" in s.extra for s in result.sizes)
    # The budget was charged what the recorded probes took (the real run: 221.6 s for 3).
    assert 0 < summary.elapsed_s < 30 * 60


CPU_GRID = Path(__file__).parents[2] / "bench" / "data" / "cpu-2core" / "tiny"


def test_the_search_replayed_on_a_complete_recorded_grid_finds_its_best(tmp_path: Path) -> None:
    """A complete grid (bench/record_grid.py: every configuration of the tiny model's
    two-rank space at every size up to its first OOM, real CPU probes under an emulated
    device, see bench/data/README.md): the replayed search ends within 2 % of the grid's best
    recorded point, answered from recordings only (a complete grid leaves nothing to refuse),
    in fewer probes than the grid has configurations."""
    facts = json.loads((CPU_GRID / "node.json").read_text())
    device = ReplayDevice.from_folder(CPU_GRID)
    workload = facts["workload"]
    tuning = prepare(
        "tiny", budget="1h", seq_len=workload["seq_len"], global_batch=workload["global_batch"],
        gpus=workload["gpus"], device=device, storage=f"sqlite:///{tmp_path}/study.db",
        trials_dir=tmp_path / "trials",
    )  # fmt: skip
    assert tuning.template.device == "cpu" and tuning.template.device_memory_bytes == (
        device.grid.key.device_memory_bytes
    )
    summary = tuning.run()
    best = device.grid.best(workload["global_batch"])
    assert best is not None and summary.best is not None
    assert (summary.best.value or 0) >= 0.98 * best[2]
    results = [ProbeResult.read(p.parent) for p in (tmp_path / "trials").rglob("result.json")]
    assert results and all(r.outcome is not Outcome.ERROR for r in results)
    assert len(results) < len(device.grid.configs())


def test_checkpointing_more_blocks_decides_points_of_its_siblings(
    device: ReplayDevice, tmp_path: Path
) -> None:
    """On a GPU, recomputing more blocks only frees device memory, and host memory does not
    depend on checkpointing: the two rules that answer a sibling's unrecorded points."""
    # fsdp z3 ac:every ran out of memory at 16 (c1-fsdp-0): ac:every-2 does at 16 too, but
    # its 8 was never measured and stays an error.
    fsdp = TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=2)
    spec = ProbeSpec(
        model="qwen2.5-1.5b", config=fsdp, micro_batch_sizes=(16,), seq_len=2048, device="cuda"
    )
    above = device.launch(spec, tmp_path / "a")
    assert above.outcome is Outcome.OOM
    assert "as recorded at micro-batch 16 for fsdp z3 ac:every" in above.sizes[0].message
    assert above.sizes[0].extra["recorded"].endswith("c1-fsdp-0.json")
    below = device.launch(dataclasses.replace(spec, micro_batch_sizes=(8,)), tmp_path / "b")
    assert below.outcome is Outcome.ERROR
    # A less checkpointed sibling's OOM says nothing of a more checkpointed one.
    single_every = TrainConfig(engine=Engine.SINGLE, ac_every=1)
    more = device.launch(
        dataclasses.replace(spec, config=single_every, micro_batch_sizes=(32,)), tmp_path / "c"
    )
    # (single ac:off ran out at 8, c1-single-0; single ac:every's own OOM was at 16, grid-2)
    assert more.outcome is Outcome.OOM
    assert more.sizes[0].message.endswith("as recorded at micro-batch 16")
    # llama-7b: deepspeed z3 off:params was killed building its states (ac:off and
    # ac:every-4 both recorded so); ac:every-2 was never probed and is killed the same way.
    llama = ReplayDevice.from_folder(FOLDER, key=GridKey("llama-7b", 2048, 1, 1, None))
    z3 = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.PARAMS, ac_every=2)
    killed = llama.launch(
        ProbeSpec(model="llama-7b", config=z3, micro_batch_sizes=(1,), device="cuda"),
        tmp_path / "d",
    )
    assert killed.outcome is Outcome.HOST_OOM
    assert "its build does not depend on checkpointing" in killed.message

"""Every device keeps the same contract: a spec in, a result out, the files a probe leaves,
and a clock that charges the budget. One test body, parametrized over the devices."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from h100 import FOLDER as H100_FOLDER

from autotune.config import TrainConfig
from autotune.devices import (
    Device,
    LocalDevice,
    ProbeClock,
    ReplayDevice,
    SimulatedDevice,
    WallClock,
)
from autotune.devices.base import SetupResult, SetupStep
from autotune.probe import Outcome, ProbeResult, ProbeSpec
from autotune.probe.forkserver import ForkServer

# device factory, and the spec it is asked: the tiny model on the CPU for real ranks (emulated
# cap), qwen2.5-1.5b on an H100 for the estimator.
CASES: dict[str, tuple[Callable[[ForkServer], Device], ProbeSpec]] = {
    "local-cpu": (
        lambda server: LocalDevice("cpu", spawner=server),
        ProbeSpec(
            model="tiny", micro_batch_sizes=(1, 2), seq_len=32, device="cpu",
            warmup_steps=1, timed_steps=2, timeout_s=120,
        ),
    ),
    "simulated": (
        lambda server: SimulatedDevice.named("h100-80gb", seed=1),
        ProbeSpec(model="qwen2.5-1.5b", micro_batch_sizes=(1, 2), seq_len=1024, device="cuda"),
    ),
    "replay": (
        lambda server: ReplayDevice.from_folder(H100_FOLDER),
        ProbeSpec(model="qwen2.5-1.5b", micro_batch_sizes=(1, 2), seq_len=2048, device="cuda"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_a_device_answers_a_probe_and_leaves_its_files(
    name: str, tmp_path: Path, fork_server: ForkServer
) -> None:
    make, spec = CASES[name]
    device = make(fork_server)
    polled: list[float] = []
    result = device.launch(spec, tmp_path / "probe", on_poll=polled.append)
    assert result.outcome is Outcome.OK, result.message
    assert [s.micro_batch_size for s in result.sizes] == [1, 2]
    assert all(s.ok and (s.tokens_per_second or 0) > 0 for s in result.sizes)
    assert all((s.peak_bytes or 0) > 0 for s in result.sizes)
    assert polled, "on_poll is called while the probe runs"
    assert result.wall_s > 0
    # What it returned is what it wrote, and the spec it was asked.
    assert (tmp_path / "probe" / "config.json").is_file()
    again = ProbeResult.read(tmp_path / "probe")
    assert again.to_dict() == result.to_dict()
    assert again.spec == spec
    assert all(s.simulated for s in result.sizes) == (device.kind == "simulated")


@pytest.mark.parametrize("name", list(CASES))
def test_a_device_clock_charges_what_its_probes_cost(name: str, fork_server: ForkServer) -> None:
    make, _ = CASES[name]
    clock = make(fork_server).clock()
    if isinstance(clock, ProbeClock):
        clock.charge(30.0)
        clock.charge(12.5)
        assert clock.elapsed() == 42.5  # the probes' own durations, not the wall clock
    else:
        assert isinstance(clock, WallClock)
        before = clock.elapsed()
        time.sleep(0.05)
        clock.charge(1000.0)  # the wall clock has moved on by itself: charging adds nothing
        assert 0.05 <= clock.elapsed() - before < 1000.0


def test_a_local_device_refuses_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="cuda or cpu"):
        LocalDevice("tpu")


def test_a_probe_template_fills_in_what_varies() -> None:
    from autotune.probe import ProbeTemplate

    template = ProbeTemplate(model="tiny", seq_len=64, num_processes=2, device="cpu")
    spec = template.spec(TrainConfig(engine="ddp"), (2, 4), timeout_s=60.0, seed=1)
    assert (spec.model, spec.seq_len, spec.num_processes, spec.device) == ("tiny", 64, 2, "cpu")
    assert spec.micro_batch_sizes == (2, 4) and spec.timeout_s == 60.0 and spec.seed == 1
    with pytest.raises(ValueError, match="engine single runs one process"):
        template.spec(TrainConfig(), (1,), timeout_s=60.0)  # validated as any spec


def test_only_a_local_deepspeed_probe_with_an_op_to_build_has_a_set_up_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The set-up steps are asked before every probe: none unless a DeepSpeed op the probe
    loads is missing (or has a torch lock), or the warm workers are not running; the
    simulated device never has one."""
    from autotune.config import Engine
    from autotune.probe.ops import library_path, torch_lock_path

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    deepspeed = ProbeSpec(
        model="tiny", config=TrainConfig(engine=Engine.DEEPSPEED), device="cpu", num_processes=2
    )
    ddp = ProbeSpec(model="tiny", config=TrainConfig(engine=Engine.DDP), device="cpu")
    assert SimulatedDevice.named("h100-80gb", seed=1).setup(deepspeed) == []
    local = LocalDevice("cpu", warm=False)
    assert local.setup(ddp) == []
    [step] = local.setup(deepspeed)
    assert step.label == "building DeepSpeed ops: deepspeed_shm_comm"
    library = library_path(tmp_path, "deepspeed_shm_comm")
    library.parent.mkdir()
    library.touch()
    assert local.setup(deepspeed) == []
    torch_lock_path(tmp_path, "deepspeed_shm_comm").touch()  # a probe killed while loading it
    assert len(local.setup(deepspeed)) == 1
    # With warm workers (the default), starting them is a step of its own, after the build.
    labels = [step.label for step in LocalDevice("cpu").setup(deepspeed)]
    assert labels == ["building DeepSpeed ops: deepspeed_shm_comm", "starting warm probe workers"]


class _NeedsSetUp:
    """The simulated GPU with one set-up step; records when the step and the probe ran."""

    kind = "simulated"

    def __init__(self, log: list[str]) -> None:
        self.inner = SimulatedDevice.named("h100-80gb", seed=1)
        self.log = log

    def setup(self, spec: ProbeSpec) -> list[SetupStep]:
        def run() -> SetupResult:
            self.log.append("set-up")
            return SetupResult(label="building", ok=True, seconds=0.0, message="built")

        return [SetupStep(label="building", run=run)]

    def launch(self, spec: ProbeSpec, probe_dir: Path, **kwargs: object) -> ProbeResult:
        self.log.append("probe")
        return self.inner.launch(spec, probe_dir)

    def clock(self) -> ProbeClock:
        return ProbeClock()

    def close(self) -> None:
        pass


def test_a_single_probe_runs_its_set_up_steps_first(tmp_path: Path) -> None:
    """`autotune probe` (api.probe) runs the device's set-up steps through the caller's hook,
    before the probe and outside its timeout, as `autotune run` does."""
    from autotune.api import probe

    log: list[str] = []
    seen: list[str] = []

    def set_up(step: SetupStep) -> SetupResult:
        seen.append(step.label)
        return step.run()

    result = probe(
        "qwen2.5-1.5b", micro_batch_sizes=(1,), device=_NeedsSetUp(log),
        trials_dir=tmp_path, set_up=set_up,
    )  # fmt: skip
    assert result.outcome is Outcome.OK
    assert seen == ["building"] and log == ["set-up", "probe"]

"""The trial database on a real SQLite file: naming, recording, infeasible OOMs, resume."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.config import ConfigError, TrainConfig
from autotune.devices import SimulatedDevice
from autotune.probe import ProbeSpec
from autotune.space import Workload
from autotune.study import Fingerprint, TrialStore, open_storage
from autotune.study import store as store_module

WORK = Workload(seq_len=4096, global_batch=512, world_size=8)
GPU = SimulatedDevice.named("h100-80gb", seed=0)


def _fingerprint(**kwargs: object) -> Fingerprint:
    base = {
        "model": "llama-7b",
        "seq_len": 4096,
        "global_batch": 512,
        "gpu": "h100-80gb",
        "gpu_memory_bytes": GPU.capacity(ProbeSpec(model="llama-7b")),
        "gpus": 8,
        "device": "simulated",
        "software": {"torch": "2.13.0", "deepspeed": "0.19.8", "transformers": "5.23.0"},
    }
    return Fingerprint(**{**base, **kwargs})  # type: ignore[arg-type]


def _probe(
    store: TrialStore,
    tmp: Path,
    config: TrainConfig,
    sizes: tuple[int, ...],
    *,
    repeat: int = 0,
    device_memory_bytes: int | None = None,
) -> None:
    trials = [store.ask(config, m, repeat=repeat) for m in sizes]
    spec = ProbeSpec(
        model="llama-7b",
        config=config,
        micro_batch_sizes=sizes,
        seq_len=4096,
        num_processes=8,
        device="cuda",
        seed=repeat,
        device_memory_bytes=device_memory_bytes,
    )
    result = GPU.launch(spec, tmp / f"probe-{len(store.measurements())}")
    store.record(trials, result)


def test_study_names_are_readable_and_separate_what_differs() -> None:
    name = _fingerprint(device="cuda").study_name
    assert name == "llama-7b/seq4096/gbs512@8xH100-80GB/torch2.13.0+ds0.19.8+tf5.23.0+probe2"
    assert _fingerprint().study_name != name  # simulated never mixes with real
    assert "2n16x" in _fingerprint(gpus=16, nodes=2).study_name
    assert _fingerprint(objective="mfu").study_name.split("/")[3] == "mfu"
    other = _fingerprint(software={"torch": "2.14.0", "deepspeed": "0.19.8", "transformers": "5"})
    assert other.study_name != _fingerprint().study_name
    driver = {**_fingerprint().software, "driver": "580.159.04"}
    assert _fingerprint(software=driver).study_name.endswith("+tf5.23.0+drv580.159.04+probe2")
    # Probes that accumulated (method 2) never mix with a study of the stand-in at
    # accumulation 1, which keeps the name it was stored under (stored without a method).
    stored = {k: v for k, v in _fingerprint(device="cuda").to_dict().items() if k != "method"}
    old = Fingerprint.from_dict(stored)
    assert old.method == 1 and old.study_name == name.removesuffix("+probe2")
    # A --device-memory cap is a study of its own: its trials' feasibility line differs.
    capped = _fingerprint(device="cuda", gpu_memory_bytes=40 << 30, capped=True).study_name
    assert capped.startswith("llama-7b/seq4096/gbs512@8xH100-80GB-cap40GiB/")
    assert _fingerprint(gpu_memory_bytes=(3 << 20) + (1 << 10), capped=True).study_name != (
        _fingerprint(gpu_memory_bytes=3 << 20, capped=True).study_name
    )
    # A precision or attention kernel the user asked for is another question.
    asked = _fingerprint(precision="fp16-mixed", attention="eager").study_name
    assert asked.split("/")[3:5] == ["fp16-mixed", "eager"]
    assert _fingerprint(precision=None, attention=None).study_name == _fingerprint().study_name
    with pytest.raises(ConfigError, match="objective"):
        _fingerprint(objective="loss")


def check_probes_become_trials(url: str, tmp_path: Path) -> TrialStore:
    """One probe's sizes as trials; OOMs (measured and inferred) are infeasible."""
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2, 4, 8))
    by_size = {m.micro_batch_size: m for m in store.measurements()}
    assert [by_size[m].outcome for m in (1, 2, 4, 8)] == ["ok", "ok", "oom", "oom"]
    assert by_size[8].attrs["inferred"] is True  # never run: larger than an OOM
    assert by_size[1].feasible and by_size[2].feasible
    assert not by_size[4].feasible and by_size[4].state == "COMPLETE"  # samplers see it
    assert by_size[4].value == 0.0
    # The value is tokens/s at the user's global batch: accumulation 512 / (2 x 8) = 32.
    assert by_size[2].grad_accum == 32
    assert by_size[2].value == pytest.approx(by_size[2].tokens_per_second)
    assert by_size[2].value > by_size[1].value > 0
    best = store.best()
    assert best is not None and best.micro_batch_size == 2
    assert best.config == TrainConfig(engine="fsdp", zero_stage=3)
    assert Path(best.probe_dir or "").is_dir()
    return store


def test_probes_become_trials_and_ooms_are_infeasible(tmp_path: Path) -> None:
    check_probes_become_trials(f"sqlite:///{tmp_path}/db/autotune.db", tmp_path)  # folder made


def test_the_best_point_is_the_mean_of_its_measurements(tmp_path: Path) -> None:
    store = TrialStore(_fingerprint(), storage=f"sqlite:///{tmp_path}/r.db")
    config = TrainConfig(engine="fsdp", zero_stage=3)
    _probe(store, tmp_path, config, (1, 2))
    _probe(store, tmp_path, config, (2,), repeat=1)
    runs = [m for m in store.measurements() if m.micro_batch_size == 2]
    assert sorted(m.repeat for m in runs) == [0, 1]
    values = [m.value or 0.0 for m in runs]
    assert values[0] != values[1]  # another seed: an independent noise draw
    best = store.best()
    assert best is not None and best.key == (config, 2)
    assert best.value == pytest.approx(sum(values) / 2)
    assert best.repeats == 2
    assert best.tokens_per_second == pytest.approx(sum(values) / 2)
    # A re-measurement that runs out of memory: the point no longer counts as fitting.
    peak = runs[0].peak_bytes
    _probe(store, tmp_path, config, (2,), repeat=2, device_memory_bytes=peak - 1)
    best = store.best()
    assert best is not None and best.key == (config, 1)


def test_headroom_makes_a_tight_fit_infeasible(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    loose = TrialStore(_fingerprint(), storage=url)
    _probe(loose, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (2,))
    peak = loose.measurements()[0].peak_bytes
    fraction = peak / GPU.capacity(ProbeSpec(model="llama-7b"))
    tight = TrialStore(_fingerprint(nodes=2), storage=url, headroom=1 - fraction + 0.01)
    _probe(tight, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (2,))
    assert loose.measurements()[0].feasible
    assert not tight.measurements()[0].feasible


def test_a_second_process_reads_the_same_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/shared.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="deepspeed", zero_stage=2), (1, 2))
    code = (
        "import sys, json\n"
        "sys.path.insert(0, 'tests/study')\n"
        "from test_store import _fingerprint\n"
        "from autotune.study import TrialStore\n"
        f"s = TrialStore(_fingerprint(), storage={url!r})\n"
        "print(json.dumps([[m.micro_batch_size, m.outcome] for m in s.measurements()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert done.stdout.strip() == '[[1, "ok"], [2, "ok"]]'


def test_running_trials_without_a_heartbeat_fail_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 1)
    monkeypatch.setattr(store_module, "GRACE_S", 1)
    url = f"sqlite:///{tmp_path}/stale.db"
    other = TrialStore(_fingerprint(), storage=url)
    other.ask(TrainConfig(engine="fsdp", zero_stage=2), 4)  # alive, but it stops beating
    time.sleep(2.5)
    resumed = TrialStore(_fingerprint(), storage=url)
    assert resumed.fail_stale() == [0]
    (m,) = resumed.measurements()
    assert (m.state, m.outcome) == ("FAIL", "stale")


def check_dead_tuner_trials_fail_at_once(url: str) -> None:
    """A tuner on this host dies mid-probe: the next one fails its trials without waiting."""
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests/study')\n"
        "from test_store import _fingerprint\n"
        "from autotune.config import TrainConfig\n"
        "from autotune.study import TrialStore\n"
        f"s = TrialStore(_fingerprint(), storage={url!r})\n"
        "s.ask(TrainConfig(engine='fsdp', zero_stage=2), 4)\n"  # then the process ends
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2], timeout=300
    )  # fmt: skip
    resumed = TrialStore(_fingerprint(), storage=url)
    alive = resumed.ask(TrainConfig(), 2)  # ours, running: left alone
    assert resumed.fail_stale() == [0]  # no heartbeat grace period to wait for
    states = {m.number: (m.state, m.outcome) for m in resumed.measurements()}
    assert states == {0: ("FAIL", "stale"), alive.number: ("RUNNING", None)}


def check_claims_never_overlap(url: str) -> None:
    """Two workers' claims on the same points: the later one withdraws, and is hidden."""
    first = TrialStore(_fingerprint(), storage=url)
    second = TrialStore(_fingerprint(), storage=url)
    config = TrainConfig(engine="fsdp", zero_stage=3)
    held = first.claim(config, [2, 4])
    assert held is not None and len(held) == 2
    assert second.claim(config, [4, 8]) is None  # 4 is in flight: the whole claim withdraws
    assert second.claim(TrainConfig(engine="fsdp", zero_stage=2), [4]) is not None
    assert second.claim(config, [8]) is not None
    # A numbered re-measurement of a point is claimed like a point of its own.
    again = second.claim(config, {2: 1})
    assert again is not None and again[0].user_attrs["repeat"] == 1
    assert first.claim(config, {2: 1}) is None
    keys = sorted((m.config.label(), m.micro_batch_size) for m in first.measurements())
    assert len(keys) == 5 and len(set(keys)) == 4  # withdrawn claims are hidden
    assert sorted(m.repeat for m in first.measurements()) == [0, 0, 0, 0, 1]
    pruned = first.study.get_trials(states=(optuna.trial.TrialState.PRUNED,))
    assert len(pruned) == 3 and all(t.user_attrs["withdrawn"] for t in pruned)


def test_running_trials_of_a_dead_tuner_on_this_host_fail_at_once(tmp_path: Path) -> None:
    check_dead_tuner_trials_fail_at_once(f"sqlite:///{tmp_path}/dead.db")


def test_two_workers_never_claim_the_same_point(tmp_path: Path) -> None:
    check_claims_never_overlap(f"sqlite:///{tmp_path}/claims.db")


def test_a_bad_storage_url_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match=r"cannot open trial storage.*sqlite:///"):
        open_storage("nosuchdb://x")


def test_a_ctrl_c_during_heartbeats_is_recorded_as_an_interruption(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT, at a random moment) while a probe's heartbeats are written, many
    times over: each time the interruption reaches the tuner as a KeyboardInterrupt, and its
    record (the trials failed as interrupted) is written. A Ctrl-C inside a heartbeat's commit
    used to leave SQLite's write lock with an orphaned connection ("database is locked" on the
    record) or come out as a database error, in about one interruption of sixteen."""
    code = (
        "import json, os, pathlib, random, signal, sys, threading\n"
        "sys.path.insert(0, 'tests/study')\n"
        "from test_store import _fingerprint\n"
        "from autotune.config import TrainConfig\n"
        "from autotune.study import TrialStore\n"
        f"store = TrialStore(_fingerprint(), storage='sqlite:///{tmp_path}/beats.db')\n"
        "pick = random.Random(0)\n"
        "for size in range(1, 81):\n"
        "    trials = store.claim(TrainConfig(), [size])\n"
        "    ctrl_c = threading.Timer(\n"
        "        pick.uniform(0, 0.03), os.kill, (os.getpid(), signal.SIGINT)\n"
        "    )\n"
        "    try:\n"
        "        ctrl_c.start()  # its signal may come before start() returns\n"
        "        while True:\n"
        "            store.beat(trials)\n"
        "    except KeyboardInterrupt:\n"
        "        ctrl_c.join()\n"
        "    store.interrupt(trials, pathlib.Path('probe'), 'interrupted')\n"
        "print(json.dumps(sorted({(m.state, m.outcome) for m in store.measurements()})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).parents[2], check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == '[["FAIL", "interrupted"]]', done.stdout

"""``bench/record_grid.py`` against the simulated GPU (a fake, named so in every result): the
points it skips are answered by the replay device as a complete recording answers them, a
recording stopped at ``--stop-after`` and resumed equals one made at once, and a grid is never
resumed on another kind of node nor overwritten.

mistral-7b at seq 2048 and global batch 16 on one simulated H100 with a 125 GiB host (the
first GPU run's node) has every kind of point: single configurations out of memory at
micro-batch 1, offload families killed by the host's OOM killer, and families that fit up to
different sizes as checkpointing changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from autotune.config import LADDER_ONLY
from autotune.devices import ReplayDevice
from autotune.models import resolve_model
from autotune.probe import Outcome, Stage
from autotune.probe.spec import ProbeSpec
from autotune.space import Workload, configurations, micro_batch_options

SCRIPT = Path(__file__).parents[2] / "bench" / "record_grid.py"
MODEL, SEQ, GBS = "mistral-7b", 2048, 16
WORKLOAD = ["--model", MODEL, "--seq-len", str(SEQ), "--global-batch", str(GBS)]
SIMULATED = ["--simulate", "h100-80gb", "--host-memory", "125GiB"]


def record(out: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), *WORKLOAD, *SIMULATED, "--out", str(out)]
    done = subprocess.run(
        [*command, "--trials-dir", str(out.parent / "trials"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def node(out: Path) -> dict:
    return json.loads((out / "node.json").read_text())


def files(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.glob("*.json")) if p.name != "node.json"}


def answers(device: ReplayDevice, folder: Path) -> dict[str, list[tuple[int, str, float]]]:
    """Every configuration of the space swept over every size, as the device answers it."""
    spec = resolve_model(MODEL)
    sizes = tuple(micro_batch_options(Workload(seq_len=SEQ, global_batch=GBS, world_size=1)))
    found = {}
    for index, config in enumerate(
        configurations(
            world_size=1,
            num_layers=spec.num_layers,
            offload=True,
            knobs=LADDER_ONLY,
        )
    ):
        probe = ProbeSpec(
            model=MODEL, config=config, micro_batch_sizes=sizes, seq_len=SEQ, device="cuda"
        )
        result = device.launch(probe, folder / str(index))
        assert result.outcome is not Outcome.ERROR, result.message
        found[config.label()] = (
            [(0, result.outcome.value, 0.0)]
            if result.outcome is Outcome.HOST_OOM
            else [
                (s.micro_batch_size, s.outcome.value, round(s.tokens_per_second or 0.0, 6))
                for s in result.sizes
            ]
        )
    return found


@pytest.fixture(scope="module")
def grids(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("grids")
    record(base / "ruled")
    record(base / "complete", "--complete")
    return base / "ruled", base / "complete"


def test_the_points_skipped_replay_as_the_complete_grid_measured_them(
    grids: tuple[Path, Path], tmp_path: Path
) -> None:
    ruled, complete = grids
    space = configurations(
        world_size=1,
        num_layers=resolve_model(MODEL).num_layers,
        offload=True,
        knobs=LADDER_ONLY,
    )
    facts = node(ruled)
    assert facts["state"] == "complete" and node(complete)["state"] == "complete"
    # Fewer probes: each configuration is a file or a skip that says why, never both.
    recorded = {p.stem for p in ruled.glob("[0-9]*.json")}
    assert len(recorded) < len(space) == len(list(complete.glob("[0-9]*.json")))
    assert recorded.isdisjoint(facts["implied"])
    assert recorded | set(facts["implied"]) == {f"{i:03d}" for i in range(len(space))}
    assert any("host_oom while building" in why for why in facts["implied"].values())
    assert any("oom from micro-batch 1" in why for why in facts["implied"].values())
    assert facts["trimmed"], "a sweep cut short by a more checkpointed sibling's OOM"
    assert node(complete)["implied"] == {}
    # The replay device answers the whole space from either, and the answers agree: sizes,
    # outcomes and tokens/s (the simulated GPU has no timing noise here).
    mine = answers(ReplayDevice.from_folder(ruled), tmp_path / "ruled")
    theirs = answers(ReplayDevice.from_folder(complete), tmp_path / "complete")
    assert mine == theirs
    assert {o for sweep in mine.values() for _, o, _ in sweep} == {"ok", "oom", "host_oom"}


def test_a_recording_stopped_and_resumed_equals_one_made_at_once(
    grids: tuple[Path, Path], tmp_path: Path
) -> None:
    ruled, _ = grids
    out = tmp_path / "grid"
    first = record(out, "--stop-after", "10m")
    assert "--resume goes on" in first.stdout and node(out)["state"] == "incomplete"
    for _ in range(10):
        if node(out)["state"] == "complete":
            break
        record(out, "--resume", "--stop-after", "10m")
    facts = node(out)
    assert facts["state"] == "complete" and len(facts["sessions"]) >= 3
    for session in facts["sessions"]:  # no session charged past its 10 minutes
        names = session["recorded"]
        assert sum(json.loads((out / f"{n}.json").read_text())["wall_s"] for n in names) <= 600

    # The same probes, skips and answers as the grid recorded in one go (the probe folders and
    # dates aside).
    def comparable(text: str) -> dict:
        data = json.loads(text)
        return {"spec": data["spec"], "outcome": data["outcome"], "sizes": data["sizes"]}

    assert {n: comparable(t) for n, t in files(out).items()} == {
        n: comparable(t) for n, t in files(ruled).items()
    }
    assert facts["implied"] == node(ruled)["implied"]


def test_a_grid_is_not_overwritten_nor_resumed_on_another_node(tmp_path: Path) -> None:
    out = tmp_path / "grid"
    record(out, "--stop-after", "3m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = record(out, check=False)
    assert again.returncode == 2 and "already holds a grid: --resume" in again.stderr
    facts = node(out)
    facts["software"]["torch"] = "0.0.0"
    (out / "node.json").write_text(json.dumps(facts))
    before["node.json"] = (out / "node.json").read_bytes()
    other = record(out, "--resume", check=False)
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1 and "recorded with software" in other.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_one_gpu_call_records_what_fits_its_time_and_packs_it(tmp_path: Path) -> None:
    """``bench/gpu_call.sh``, a GPU session's call, run here on the simulated GPU: it records
    into the node's folder, stops before its limit and packs the folder for $OUT."""
    out, grids = tmp_path / "out", tmp_path / "grids"
    out.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "NODE": "simulated-h100",
        "GRIDS": str(grids),
        "WHEELS": str(tmp_path / "no-wheels"),  # this environment has what the node lacks
    }
    script = SCRIPT.parent / "gpu_call.sh"

    def call(stop: str) -> subprocess.CompletedProcess[str]:
        command = ["bash", str(script), "grid", MODEL, str(GBS), stop, "--", *SIMULATED]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    for _ in range(2):  # the second call resumes the first's folder
        done = call("6m")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "gpu_call grid: exit 0" in done.stdout
        assert "--resume goes on" in done.stdout
    with tarfile.open(out / "grid.tar.gz") as packed:
        names = set(packed.getnames())
    folder = grids / "simulated-h100" / MODEL
    assert {f"simulated-h100/{MODEL}/{p.name}" for p in folder.glob("*.json")} <= names
    facts = node(folder)
    assert facts["state"] == "incomplete" and len(facts["sessions"]) == 2
    assert [len(s["recorded"]) for s in facts["sessions"]] == [2, 1]
    # The next configuration takes longer than a call that short: said, and nothing recorded.
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    short = call("2m")
    assert (
        short.returncode == 2 and "more than --stop-after 2m00s: give it more time" in short.stdout
    )
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    wrong = subprocess.run(
        ["bash", str(script), "nothing"], env=env, capture_output=True, text=True, timeout=60
    )
    assert (
        wrong.returncode == 2
        and "unknown task nothing: use grid, run, overhead or noise" in wrong.stderr
    )


def test_states_that_do_not_fit_are_probed_once(tmp_path: Path) -> None:
    """Real CPU probes under an emulated 256 KiB device: the tiny model's states do not fit,
    so its most checkpointed configuration runs out of memory while being built, and the
    others are decided by it; the replay answers them as a complete recording does."""
    cpu = ["--model", "tiny", "--device", "cpu", "--device-memory", "256KiB", "--gpus", "1"]
    cpu += ["--seq-len", "128", "--global-batch", "8", "--trials-dir", str(tmp_path / "trials")]
    folders = {}
    for name, extra in (("ruled", []), ("complete", ["--complete"])):
        folders[name] = tmp_path / name
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *cpu, "--out", str(folders[name]), *extra],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    space = configurations(
        world_size=1,
        num_layers=resolve_model("tiny").num_layers,
        offload=False,
        knobs=LADDER_ONLY,
    )
    assert len(space) >= 2
    ruled = node(folders["ruled"])
    assert len(list(folders["ruled"].glob("[0-9]*.json"))) == 1
    assert len(ruled["implied"]) == len(space) - 1
    assert all("oom while building" in why for why in ruled["implied"].values())
    for config in space:
        spec = ProbeSpec(
            model="tiny",
            config=config,
            micro_batch_sizes=(1, 2),
            seq_len=128,
            device="cpu",
            device_memory_bytes=256 * 1024,
        )
        replies = [
            ReplayDevice.from_folder(folder).launch(spec, tmp_path / name / config.label())
            for name, folder in folders.items()
        ]
        for reply in replies:
            assert (reply.outcome, reply.stage, reply.sizes) == (Outcome.OOM, Stage.BUILD, [])

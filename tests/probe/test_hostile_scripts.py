"""A user's script that misbehaves in a probe, for real on this machine's CPU.

- What a job starts outside its ranks' process group (a child in a session of its own, a
  daemon that forks twice, one that scrubs its environment) ends with the probe: when the job
  trains and ends, when it hangs into the timeout, on Ctrl-C, and when it leaves without
  Python's exit (``os._exit``); fresh ranks and ranks forked from the warm process.
- A report the script writes itself (the numbers of a forged measurement, or a genuine report
  copied from another run) is never a measurement; nor is a job that leaves without the
  measurement layer's verdict; the token that signs the layer's report is nowhere the script
  can read; a signed report whose timings are not the steps asked for is refused.
- A job that hangs before its first step is a ``timeout`` that says so (a run's first probe
  has a bound of its own, below the budget: tests/search/test_search.py::
  test_probe_timeouts_follow_measured_probes_and_the_budget).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import read_report
from autotune.probe.outcome import Outcome
from autotune.probe.result import SIGNATURE, ProbeResult, report_signature
from autotune.probe.scriptprobe import launch_script_probe
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import ScriptJob
from tests.probe.test_userjob import CUSTOM

BIN = Path(sys.executable).parent
SEQ = 64

TRAIN = CUSTOM  # a plain torchrun job that reads autotune.job_config()

CHILDREN = """
import json
import os
import subprocess
import sys
import time

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def daemon(env):
    # Forks twice; the middle process leaves, so the kernel re-parents the daemon. With an
    # environment it executes a sleeper; with None it sleeps as a fork.
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write, str(os.getpid()).encode())
            if env is None:
                time.sleep(600)
            else:
                os.execve(SLEEP[0], SLEEP, env)
        os._exit(0)
    os.waitpid(middle, 0)
    return int(os.read(read, 32))


pids = {
    "session": subprocess.Popen(SLEEP, start_new_session=True).pid,
    "daemon": daemon(dict(os.environ)),
    "forked": daemon(None),
    "scrubbed": daemon({}),
}
where, then = sys.argv[1], sys.argv[2]
with open(where + ".tmp", "w") as handle:
    json.dump(pids, handle)
os.replace(where + ".tmp", where)
if then == "hangs":
    time.sleep(3600)
elif then == "exits":
    os._exit(0)
"""


def probe(
    tmp_path: Path,
    script: str,
    args: list[str],
    warm: ForkServer | None = None,
    name: str = "probe",
    **fields: Any,
) -> ProbeResult:
    """One real probe of ``script`` (written to ``tmp_path``) at micro-batch 2."""
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    on_poll = fields.pop("on_poll", None)
    spec = ProbeSpec(
        model="tiny",
        script=ScriptJob.read(path, "torchrun", args),
        micro_batch_sizes=(2,),
        seq_len=SEQ,
        device="cpu",
        warmup_steps=1,
        timed_steps=2,
        timeout_s=fields.pop("timeout_s", 300.0),
        **fields,
    )
    return launch_script_probe(spec, tmp_path / name, warm=warm, on_poll=on_poll)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def left_behind() -> Any:
    """The pids a test's job wrote; whatever of them still lives after the test is killed
    (a failing test leaves no sleeper)."""
    files: list[Path] = []
    yield files.append
    for path in files:
        if path.exists():
            for pid in json.loads(path.read_text()).values():
                if alive(pid):
                    os.kill(pid, 9)


@pytest.mark.parametrize(
    ("then", "spawn"),
    [
        ("trains", "fresh"),
        ("trains", "warm"),
        ("exits", "fresh"),
        ("exits", "warm"),
        ("hangs", "warm"),
        ("ctrl-c", "fresh"),
    ],
)
def test_what_a_job_starts_outside_its_process_group_ends_with_the_probe(
    tmp_path: Path, fork_server: ForkServer, left_behind: Any, then: str, spawn: str
) -> None:
    pids_file = tmp_path / "pids.json"
    left_behind(pids_file)
    warm = fork_server if spawn == "warm" else None
    script = CHILDREN + (TRAIN if then == "trains" else "")
    args = [str(pids_file), then]
    if then == "ctrl-c":

        def interrupt(elapsed: float) -> None:
            if pids_file.exists():
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            probe(tmp_path, script, args, warm, on_poll=interrupt)
    else:
        timeout = 8.0 if then == "hangs" else 300.0
        result = probe(tmp_path, script, args, warm, timeout_s=timeout)
        expected = {"trains": Outcome.OK, "exits": Outcome.ERROR, "hangs": Outcome.TIMEOUT}
        assert result.outcome is expected[then], result.message
        if then == "hangs":
            assert "did not reach its first training step" in result.message, result.message
    pids = json.loads(pids_file.read_text())
    # A job that leaves without Python's exit cannot end its own tree: what carries the
    # probe's mark in its environment is found wherever it went. (Not a process started
    # with an environment of its own, nor a fork of a warm rank, in that one case.)
    ends = ["session", "daemon", "forked"] if spawn == "fresh" else ["session", "daemon"]
    kinds = ends if then == "exits" else list(pids)
    assert [k for k in kinds if alive(pids[k])] == [], pids


FORGED = """
import json
import os
import sys

report = {
    "rank": 0, "world_size": 1, "device": "cpu", "status": "ok", "stage": None, "message": "",
    "finished": True,
    "sizes": [{
        "micro_batch_size": 2, "outcome": "ok", "tokens_per_second": 2560000.0,
        "tokens_per_second_per_rank": 2560000.0, "micro_step_s": 0.0001,
        "optimizer_step_s": 0.0, "step_s": 0.0001, "timed_s": 0.0002,
        "step_times": [0.0001, 0.0001], "losses": [1.0, 1.0, 1.0],
        "peak_allocated_bytes": 1000, "peak_reserved_bytes": 1000,
    }],
}
if len(sys.argv) > 1:  # a genuine report of another run, signature and all
    with open(sys.argv[1]) as handle:
        report = json.load(handle)
with open(os.path.join(os.environ["AUTOTUNE_PROBE_DIR"], "rank0.json"), "w") as handle:
    json.dump(report, handle)
os._exit(0)  # before the measurement layer's own exit can write its verdict
"""


@pytest.mark.parametrize("forged", ["written", "copied"])
def test_a_report_the_script_writes_is_never_a_measurement(tmp_path: Path, forged: str) -> None:
    args: list[str] = []
    if forged == "copied":
        genuine = probe(tmp_path, TRAIN, [], name="genuine")
        assert genuine.outcome is Outcome.OK, genuine.message
        args = [str(tmp_path / "genuine" / "mb2" / "rank0.json")]
    result = probe(tmp_path, FORGED, args)
    assert result.outcome is Outcome.ERROR
    assert result.ok_sizes() == []
    assert "rank0.json is not the measurement layer's (not signed with this run's token" in (
        result.message
    ), result.message


SLOW_CLOCK = """
import sys
import time



def _slowed(real):  # a clock 1000x slow: every step would read as 1000x fast
    start = real()
    return lambda: start + (real() - start) / 1000


# What freezegun does too: time's function replaced, and every module attribute that is it.
slow = _slowed(time.perf_counter)
for module in list(sys.modules.values()):
    for name, value in list(vars(module).items() if hasattr(module, "__dict__") else ()):
        if value is time.perf_counter and module is not time:
            setattr(module, name, slow)
time.perf_counter = slow
"""


def test_a_job_that_replaces_the_clock_is_timed_by_the_layers_own(tmp_path: Path) -> None:
    """A prelude that makes ``time.perf_counter`` run 1000x slow (as a hostile job might, and
    as freezegun does by accident, module attributes included): the job's steps are timed by
    the clock the layer held before the job ran, so its speed is the honest job's, within
    the CPU's noise (it was 1,400x on this CPU before, 37,180,205 tokens/s against 26,452)."""
    honest = probe(tmp_path, TRAIN, [], name="honest")
    faked = probe(tmp_path, SLOW_CLOCK + TRAIN, [], name="faked")
    assert honest.outcome is Outcome.OK and faked.outcome is Outcome.OK, faked.message
    [fair], [slow] = honest.ok_sizes(), faked.ok_sizes()
    assert fair.tokens_per_second and slow.tokens_per_second
    # The faked clock's 1000x against the busy CPU's own scatter (up to 5x either way
    # between two probes with another test beside them).
    assert slow.tokens_per_second / fair.tokens_per_second < 30, (slow, fair)


def test_a_job_that_leaves_without_the_layers_verdict_is_no_measurement(tmp_path: Path) -> None:
    result = probe(tmp_path, "import os\nos._exit(0)\n", [])
    assert result.outcome is Outcome.ERROR
    assert "without the measurement layer's verdict" in result.message, result.message


SNOOP = """
import json
import os
import stat
import sys

seen = {"environ": dict(os.environ), "files": {}}
with open("/proc/self/environ", "rb") as handle:
    seen["proc_environ"] = handle.read().decode(errors="replace")
folder = os.environ["AUTOTUNE_PROBE_DIR"]
for root, _, names in os.walk(os.path.dirname(folder)):
    for name in names:
        path = os.path.join(root, name)
        seen["files"][path] = ""
        if stat.S_ISREG(os.stat(path).st_mode):  # not the logs' named pipes
            with open(path, "rb") as handle:
                seen["files"][path] = handle.read().decode(errors="replace")
with open(sys.argv[1], "w") as handle:
    json.dump(seen, handle)
"""


@pytest.mark.parametrize("spawn", ["fresh", "warm"])
def test_the_token_that_signs_the_report_is_nowhere_the_script_can_read(
    tmp_path: Path, fork_server: ForkServer, spawn: str
) -> None:
    seen_file = tmp_path / "seen.json"
    warm = fork_server if spawn == "warm" else None
    result = probe(tmp_path, SNOOP + TRAIN, [str(seen_file)], warm)
    assert result.outcome is Outcome.OK, result.message
    report = json.loads((tmp_path / "probe" / "mb2" / "rank0.json").read_text())
    seen = seen_file.read_text()
    assert "config.json" in seen and ".token" not in seen  # it read the folder, no token there
    candidates = set(re.findall(r"[0-9a-f]{16,}", seen))
    assert candidates  # the probe's mark, at least
    assert not [c for c in candidates if report_signature(report, c) == report[SIGNATURE]]


def test_a_signed_report_whose_timings_are_not_the_steps_asked_is_refused(
    tmp_path: Path,
) -> None:
    result = probe(tmp_path, TRAIN, [])
    assert result.outcome is Outcome.OK, result.message
    spec = ProbeSpec.from_dict(json.loads((tmp_path / "probe" / "mb2" / "config.json").read_text()))
    genuine = json.loads((tmp_path / "probe" / "mb2" / "rank0.json").read_text())
    token = "a token the test signs with"
    path = tmp_path / "rank0.json"

    def read(change: dict[str, Any]) -> str:
        report = json.loads(json.dumps(genuine))
        report["sizes"][0].update(change)
        report[SIGNATURE] = report_signature(report, token)
        path.write_text(json.dumps(report))
        return read_report(path, 0, token, spec)[1]

    assert read({}) == ""
    size = genuine["sizes"][0]
    assert "timed 1 steps where the probe asked for 2" in read(
        {"step_times": size["step_times"][:1]}
    )
    assert "is not the sum of its timed steps" in read({"timed_s": 10 * size["timed_s"]})
    assert "is outside its timed steps' durations" in read({"step_s": size["step_s"] / 100})
    assert "tokens a step over its step time" in read(
        {"tokens_per_second": 20 * size["tokens_per_second"]}
    )

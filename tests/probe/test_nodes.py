"""Probes across nodes: the host lists, the launch lines, and real two-node probes on loopback.

This machine has no second node, so two "nodes" are two node agents on it, each with its own
process group, meeting in torch.distributed's rendezvous on 127.0.0.1 (gloo). ``srun`` and
``ssh`` are fakes (named as such) that run the command they are given on this machine, as the
real ones run it on a node: what they check is the launch line autotune builds and that the
agents behave under them as on a real node (node rank from Slurm's variables; the end of an
``ssh`` session ends the ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import kill_tuner_once_ranks_run, probe_failure_text, probe_processes

from autotune.config import ConfigError, Engine, TrainConfig
from autotune.probe.launcher import launch_probe
from autotune.probe.lifetime import PARENT_ENV
from autotune.probe.nodes import (
    Nodes,
    agent_launches,
    expand_hostlist,
    forwarded_environment,
    nodes_from_environment,
)
from autotune.probe.outcome import Outcome
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

ROOT = Path(__file__).parents[2]
LOOPBACK = Nodes(hosts=("127.0.0.1", "127.0.0.2"), via="local")


def _spec(**overrides: object) -> ProbeSpec:
    fields: dict[str, object] = {
        "model": "tiny",
        "config": TrainConfig(engine=Engine.DDP),
        "micro_batch_sizes": (1, 2),
        "seq_len": 32,
        "num_processes": 1,
        "nodes": 2,
        "device": "cpu",
        "warmup_steps": 1,
        "timed_steps": 2,
        "timeout_s": 120.0,
    }
    fields.update(overrides)
    return ProbeSpec(**fields)  # type: ignore[arg-type]


def _node_reports(result: ProbeResult) -> list[dict[str, object]]:
    return [json.loads((result.probe_dir / f"node{k}.json").read_text()) for k in range(2)]


def _no_leftovers(result: ProbeResult) -> None:
    left = probe_processes(result)
    assert not left, f"processes of the probe outlived it: {left}"


# --- host lists and launch lines (pure) ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b5,c[09-10]", ["a1", "a2", "b5", "c09", "c10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node[8]", ["node8"]),
    ],
)
def test_slurm_host_lists_expand_as_scontrol_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-03", "gpu01]", "gpu[a-b]"])
def test_a_malformed_host_list_is_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match="host list"):
        expand_hostlist(text)


def test_the_nodes_come_from_hosts_then_slurm_then_nowhere() -> None:
    slurm = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    found = nodes_from_environment(slurm, nodes=None, hosts=None)
    assert found == Nodes(hosts=("gpu01", "gpu02", "gpu03", "gpu04"), via="srun")
    assert found.master_addr == "gpu01"
    assert nodes_from_environment(slurm, nodes=2, hosts=None) == Nodes(
        hosts=("gpu01", "gpu02"), via="srun"
    )
    assert nodes_from_environment(slurm, nodes=1, hosts=None) is None
    with pytest.raises(ConfigError, match="this Slurm allocation has 4 nodes"):
        nodes_from_environment(slurm, nodes=8, hosts=None)
    assert nodes_from_environment({}, nodes=None, hosts=None) is None
    with pytest.raises(ConfigError, match="--nodes 2 needs the hosts"):
        nodes_from_environment({}, nodes=2, hosts=None)
    # --hosts wins over Slurm; hosts other than this one are reached by ssh.
    mixed = nodes_from_environment(slurm, nodes=None, hosts=["localhost", "node2"])
    assert mixed == Nodes(hosts=("localhost", "node2"), via="ssh")
    assert nodes_from_environment({}, nodes=None, hosts=["127.0.0.1", "127.0.0.2"]) == LOOPBACK
    assert LOOPBACK.master_addr == "127.0.0.1"
    with pytest.raises(ConfigError, match="put this host first"):
        nodes_from_environment({}, nodes=None, hosts=["node2", "localhost"])
    with pytest.raises(ConfigError, match="names a host twice"):
        nodes_from_environment({}, nodes=None, hosts=["localhost", "node2", "node2"])
    with pytest.raises(ConfigError, match="--hosts names 2"):
        nodes_from_environment({}, nodes=3, hosts=["localhost", "node2"])


def test_srun_starts_one_agent_per_node_and_ssh_one_quoted_command_per_host(
    tmp_path: Path,
) -> None:
    probe_dir = tmp_path / "m $(touch pwned) 'x"
    srun = agent_launches(probe_dir, Nodes(hosts=("g1", "g2"), via="srun"), 29500, {})
    assert len(srun) == 1 and srun[0].remote and not srun[0].watch
    argv = srun[0].argv
    assert argv[:7] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=g1,g2",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]
    assert argv[7:11] == [sys.executable, "-m", "autotune.probe.agent", str(probe_dir)]
    assert "--node-rank" not in argv  # each task takes SLURM_NODEID
    assert argv[argv.index("--master-addr") + 1] == "g1"

    environ = {
        "AUTOTUNE_TEST_FAULT": "hang@1",
        "AUTOTUNE_STORAGE": "postgresql://u:s3cret@db/x",
        "NCCL_DEBUG": "INFO",
        "HF_TOKEN": "hf_s3cret",
        "HOME": "/root",
    }
    environ[PARENT_ENV] = "123"
    # Nothing of autotune's own is forwarded (the ranks never need the storage URL; test
    # faults travel in the probe folder), and nothing forwarded is on a command line.
    assert forwarded_environment(environ) == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_s3cret"}
    local, remote = agent_launches(
        probe_dir, Nodes(hosts=("localhost", "node2"), via="ssh"), 29500, environ
    )
    assert not local.remote and local.argv[local.argv.index("--node-rank") + 1] == "0"
    assert not local.environment
    assert remote.remote and remote.watch
    assert remote.environment == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_s3cret"}
    assert remote.argv[:5] == ["ssh", "-o", "BatchMode=yes", "--", "node2"]
    assert not any("s3cret" in word or "NCCL_DEBUG" in word for word in remote.argv)
    # The remote shell gets one string in which every word is quoted: the hostile folder name
    # is one argument of the agent, and runs nothing.
    words = ["sh", "-c", f"printf '%s\\n' {remote.argv[5].split(' && exec ', 1)[1]}"]
    printed = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(probe_dir) in printed.stdout.splitlines()
    assert "--watch-stdin" in printed.stdout.splitlines()
    assert not (tmp_path / "pwned").exists()


# --- real probes over two loopback "nodes" ------------------------------------------------


def test_two_nodes_on_loopback_train_as_one_world_in_two_process_groups(tmp_path: Path) -> None:
    result = launch_probe(_spec(), tmp_path / "probe", nodes=LOOPBACK)
    _no_leftovers(result)
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    assert [s.outcome for s in result.sizes] == [Outcome.OK, Outcome.OK]
    reports = _node_reports(result)
    assert [r["node"] for r in reports] == [0, 1]
    assert [[e["rank"] for e in r["ranks"]] for r in reports] == [[0], [1]]  # type: ignore[index]
    groups = {r["pgid"] for r in reports}
    assert len(groups) == 2, "each node's ranks are a process group of their own"
    for rank in (0, 1):
        report = json.loads((result.probe_dir / f"rank{rank}.json").read_text())
        assert report["world_size"] == 2 and report["rank"] == rank
    assert [e["returncode"] for e in result.exits] == [0, 0]
    assert result.spawn == "fresh"
    cmd = (result.probe_dir / "cmd.txt").read_text()
    assert "torchrun --nnodes 2 --node-rank K --nproc-per-node 1 --master-addr 127.0.0.1" in cmd


def test_a_rank_killed_on_the_second_node_is_the_probes_verdict_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1, on node 1, is killed as the kernel's OOM killer would: the probe is a host
    OOM blamed on rank 1, rank 0 on the other node (which loses its peer) is not blamed, and
    no process of either node outlives the probe."""
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "sigkill@1")
    result = launch_probe(_spec(), tmp_path / "probe", nodes=LOOPBACK)
    _no_leftovers(result)
    assert result.outcome is Outcome.HOST_OOM, probe_failure_text(result)
    assert result.failed_rank == 1
    by_rank = {e["rank"]: e for e in result.exits}
    assert by_rank[1]["returncode"] == -signal.SIGKILL and not by_rank[1]["killed_by_launcher"]
    # Rank 0 either saw its peer go (gloo closes the connection) or was stopped: its agent
    # reaped it and knows how it ended.
    assert isinstance(by_rank[0]["returncode"], int)


def test_a_hang_across_nodes_times_out_and_every_agent_stops_its_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "hang")
    result = launch_probe(_spec(timeout_s=8.0), tmp_path / "probe", nodes=LOOPBACK)
    _no_leftovers(result)
    assert result.outcome is Outcome.TIMEOUT, probe_failure_text(result)
    for report in _node_reports(result):
        assert all(e["killed_by_agent"] for e in report["ranks"])  # type: ignore[index]


# --- under fake srun and ssh --------------------------------------------------------------

FAKE_SRUN = """\
#!{python}
# A fake srun (this machine has no Slurm): runs the step's command once per task on this
# machine with the variables a task gets, forwards SIGTERM to the tasks as srun does, and
# records the command line it was given.
import os, signal, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
opts = {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
tasks = []
for task in range(int(opts["ntasks"])):
    env = {{**os.environ, "SLURM_NODEID": str(task), "SLURM_PROCID": str(task),
           "SLURM_STEP_NODELIST": opts["nodelist"]}}
    tasks.append(subprocess.Popen(args, env=env))
def forward(signum, frame):
    for t in tasks:
        if t.poll() is None:
            t.send_signal(signum)
signal.signal(signal.SIGTERM, forward)
codes = [t.wait() for t in tasks]
sys.exit(max((abs(c) for c in codes), default=0))
"""

FAKE_SSH = """\
#!/bin/sh
# A fake ssh (this machine has no second host): records its command line, drops the options,
# the "--" and the host, then runs the remote command in a shell here with a fresh login's
# environment (nothing of the caller's but PATH and HOME), its standard input the session's,
# as sshd would.
[ -n "$FAKE_SSH_LOG" ] && printf '%s\\n' "$*" >> "$FAKE_SSH_LOG"
while [ "$1" = "-o" ]; do shift 2; done
[ "$1" = "--" ] && shift
shift
exec env -i PATH="$PATH" HOME="$HOME" /bin/sh -c "$1"
"""


def _fake(bin_dir: Path, name: str, text: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_probe_inside_a_slurm_allocation_starts_its_agents_with_srun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "srun", FAKE_SRUN.format(python=sys.executable))
    log = tmp_path / "srun.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(log))
    slurm = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "127.0.0.[1-2]"}
    nodes = nodes_from_environment(slurm, nodes=None, hosts=None)
    assert nodes is not None and nodes.via == "srun"
    result = launch_probe(_spec(micro_batch_sizes=(2,)), tmp_path / "probe", nodes=nodes)
    _no_leftovers(result)
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    line = log.read_text()
    assert line.startswith(
        "--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=127.0.0.1,127.0.0.2"
    )
    assert "-m autotune.probe.agent" in line and "--node-rank" not in line
    assert [r["node"] for r in _node_reports(result)] == [0, 1]


TUNER = """
import sys
from pathlib import Path
from autotune.config import TrainConfig
from autotune.probe import faults
faults.arm()  # the test suite's tuner: its AUTOTUNE_TEST_FAULT reaches the ranks
from autotune.probe.launcher import launch_probe
from autotune.probe.nodes import Nodes
from autotune.probe.spec import ProbeSpec
spec = ProbeSpec(model="tiny", config=TrainConfig(engine="ddp"), micro_batch_sizes=(1,),
                 seq_len=32, num_processes=1, nodes=2, device="cpu", timeout_s=600.0)
launch_probe(spec, Path(sys.argv[1]), nodes=Nodes(hosts=tuple(sys.argv[3:]), via=sys.argv[2]))
"""


@pytest.mark.parametrize(
    ("via", "second"), [("local", "127.0.0.2"), ("ssh", "node2")], ids=["local", "ssh"]
)
def test_every_nodes_ranks_die_with_a_killed_tuner(tmp_path: Path, via: str, second: str) -> None:
    """The tuner is SIGKILLed while both nodes' ranks hang: an agent started here dies with
    it (and its ranks with the agent); one started through ssh sees its session end and stops
    its ranks."""
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "ssh", FAKE_SSH)
    probe_dir = tmp_path / "probe"
    env = {
        **os.environ,
        "AUTOTUNE_TEST_FAULT": "hang",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    tuner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TUNER), str(probe_dir), via, "127.0.0.1", second],
        env=env,
        start_new_session=True,
        cwd=ROOT,
    )
    kill_tuner_once_ranks_run(tuner, probe_dir, ranks=2, processes=4)  # 2 agents, 2 ranks


def test_ssh_carries_the_environment_on_stdin_and_no_secret_on_any_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ssh (a fake that gives the remote command a fresh login's environment), the
    remote rank gets what it needs of the tuner's environment from the session's standard
    input; the storage URL's password and a token reach no command line (``ps`` on either
    host), no ``cmd.txt``, and no rank's environment; the hang the suite asked of the remote
    rank reaches it through the shared probe folder."""
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "ssh", FAKE_SSH)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://tuner:s3cret-pw@db/autotune")
    monkeypatch.setenv("GLOO_AUTOTUNE_MARKER", "forwarded")
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "hang@1")
    seen: dict[str, str] = {}
    command_lines: list[str] = []
    probe_dir = tmp_path / "probe"

    def watch() -> None:  # the remote rank's environment, read while it hangs
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not seen:
            for process in psutil.process_iter(["cmdline"]):
                line = " ".join(process.info["cmdline"] or [])
                if str(probe_dir) not in line:
                    continue
                command_lines.append(line)
                with contextlib.suppress(psutil.Error):
                    environ = process.environ()
                    if environ.get("RANK") == "1" and "autotune.probe.worker" in line:
                        seen.update(environ)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    nodes = Nodes(hosts=("127.0.0.1", "node2"), via="ssh")
    result = launch_probe(_spec(timeout_s=20.0), probe_dir, nodes=nodes)
    watcher.join()
    _no_leftovers(result)
    assert result.outcome is Outcome.TIMEOUT, probe_failure_text(result)
    assert seen.get("GLOO_AUTOTUNE_MARKER") == "forwarded", sorted(seen)
    assert "AUTOTUNE_STORAGE" not in seen and "AUTOTUNE_TEST_FAULT" not in seen
    written = log.read_text() + (probe_dir / "cmd.txt").read_text() + "\n".join(command_lines)
    assert "-- node2" in log.read_text()
    assert "s3cret-pw" not in written and "GLOO_AUTOTUNE_MARKER" not in written


FAILING_SSH = """\
#!/bin/sh
# An ssh that cannot reach its host: ssh's own exit code for its own errors is 255.
echo "ssh: connect to host node2 port 22: Connection refused" >&2
exit 255
"""


def test_an_agent_that_cannot_start_is_the_nodes_fault_said_at_once(tmp_path: Path) -> None:
    """``ssh`` fails at once: the probe is not left to its timeout, and neither its verdict
    nor the run's is about the configuration. ``autotune run`` stops with one line naming
    the host and what to check, exit 1, and records nothing against the configuration."""
    from tests.test_cli import autotune

    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "ssh", FAILING_SSH)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    done = autotune(
        "run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB", "--seq-len",
        "32", "--hosts", "127.0.0.1,node2", "--budget", "10m", "--storage", storage, "--json",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["best"] is None and summary["probes"] == 0
    reason = summary["stop_reason"]
    assert reason.startswith("the node agent on node2 did not start (ssh exited 255: ssh: "), reason
    assert "check that 'ssh node2 true' works" in reason and "nothing was recorded" in reason
    listed = autotune("trials", "--storage", storage, "--json", cwd=tmp_path)
    assert json.loads(listed.stdout)[0]["trials"] == []


def test_autotune_run_tunes_across_two_nodes_and_exports_their_launch(tmp_path: Path) -> None:
    """``autotune run --hosts`` end to end on two loopback nodes: the study is the two-node
    workload's, its probes ran an agent per node, and the export launches on both nodes."""
    from tests.test_cli import autotune

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    common = ("--storage", storage)
    done = autotune(
        *("run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB"),
        *("--hosts", "127.0.0.1,127.0.0.2", "--engine", "ddp", "--seq-len", "64"),
        *("--global-batch", "16", "--budget", "2m", "--trials-dir", "trials", "--json"),
        # Two configurations (ac:off, ac:every): the search ends, not its budget.
        *("--loss", "full", "--no-ac-ops", "--no-act-offload", "--optimizer", "adamw"),
        *common,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert "@2n2xCPU" in summary["study"]
    probe_dir = tmp_path / summary["best"]["probe_dir"]
    assert (probe_dir / "node0.json").is_file() and (probe_dir / "node1.json").is_file()
    config = json.loads((probe_dir / "config.json").read_text())
    assert (config["nodes"], config["num_processes"]) == (2, 1)
    exported = autotune("export", "--format", "torchrun", *common, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "export NNODES=2" in exported.stdout and "--nnodes=2" in exported.stdout

"""Start a probe's ranks as one process group, bound them in time, and collect the result.

The launcher starts the ranks itself (the same environment torchrun would give them), in a
new process group that holds every rank and anything they spawn. Rank 0 leads the group; out
of the terminal's foreground group, a Ctrl-C reaches the tuner, which stops the probe. So
each rank's exact exit status is known (torchrun reports a dead child only as its own exit
code 1), and one ``killpg`` ends everything at a timeout; what the ranks started outside the
group (a session of its own, a daemon re-parented to init) is found by the probe's mark in its
environment and ends too (:mod:`autotune.probe.lifetime`): nothing outlives a probe. ``cmd.txt``
holds the equivalent torchrun command to rerun a probe by hand. A rank report of the user's
job counts only when the measurement layer signed it with the rank's token
(:func:`~autotune.probe.result.job_report_problem`).

Each probe gets a folder: config.json (the spec), cmd.txt, stdout.log, stderr.log (all ranks,
in order of writing, each capped to its head and tail: :mod:`autotune.probe.output`),
rank<N>.json (each rank's own report) and result.json (merged).

A folder the probe cannot write (a read-only or full file system) or one deleted while the
ranks run makes the probe an ``error`` that names the folder, never an exception: no rank is
started in the first case, the ranks are stopped at once in the second.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autotune.handoff.launch import threads_per_rank
from autotune.probe.faults import FAULT_FILE, write_request
from autotune.probe.lifetime import MARK_ENV, PARENT_ENV, descendants, kill_all, marked, new_mark
from autotune.probe.nodes import (
    NODE_REPORT,
    AgentLaunch,
    Nodes,
    agent_launches,
    read_node_report,
)
from autotune.probe.ops import op_environment
from autotune.probe.outcome import Classification, Outcome, RankExit, Stage, classify_probe
from autotune.probe.output import OutputKeeper
from autotune.probe.result import (
    TOKEN_FILE,
    ProbeResult,
    job_report_problem,
    merge_sizes,
    report_problem,
)
from autotune.probe.spec import ProbeSpec

FAILURE_GRACE_S = 5.0
"""After one rank fails, how long the others get to write their reports before being killed."""
TERM_GRACE_S = 3.0
"""Between SIGTERM and SIGKILL when the launcher ends a probe."""
EXIT_GRACE_S = 10.0
"""Once every rank's report says it finished, how long the ranks get to exit before the
launcher stops them; their measurements stand (a teardown that hangs, e.g. a process group
whose store went with the rank that hosted it, costs this much, not the probe's timeout)."""
FINISH_POLL_S = 0.5
"""How often the launcher reads the ranks' reports for their ``finished`` mark."""


def free_port() -> int:
    """A TCP port free on the loopback interface right now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def new_probe_dir(trials_dir: Path, study: str) -> Path:
    """A fresh numbered folder ``trials_dir/study/N`` (safe against concurrent tuners)."""
    root = trials_dir / study
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()]
    number = max(taken, default=-1) + 1
    while True:
        candidate = root / str(number)
        try:
            candidate.mkdir()  # atomic: two tuners never get the same folder
            return candidate
        except FileExistsError:
            number += 1


def worker_command(probe_dir: Path) -> list[str]:
    """The command each rank runs."""
    return [sys.executable, "-m", "autotune.probe.worker", str(probe_dir)]


def rank_environment(
    spec: ProbeSpec, rank: int, port: int, *, node_rank: int = 0, master_addr: str = "127.0.0.1"
) -> dict[str, str]:
    """torchrun's variables for the ``rank``-th rank of node ``node_rank``, and where
    DeepSpeed builds its ops (one folder per Python environment unless the user chose one; a
    ``TORCH_CUDA_ARCH_LIST`` DeepSpeed can parse: :func:`~autotune.probe.ops.op_environment`)."""
    env = op_environment(os.environ)
    env.update(
        RANK=str(node_rank * spec.num_processes + rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.num_processes),
        GROUP_RANK=str(node_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
        # Start-up time is measured from here (process creation times are whole-second coarse).
        AUTOTUNE_SPAWN_TIME=repr(time.time()),
    )
    if not os.environ.get("OMP_NUM_THREADS"):
        # Ranks share the cores, as every shell export has them share (launch.thread_lines).
        cores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(threads_per_rank(cores, spec.num_processes))
    return env


def _write_command(
    spec: ProbeSpec,
    probe_dir: Path,
    port: int,
    spawn: str,
    nodes: Nodes | None,
    launches: list[AgentLaunch],
) -> None:
    worker = worker_command(probe_dir)
    folder = shlex.quote(str(probe_dir))
    lines = [
        "# Rerun this probe by hand (from the directory autotune ran in):",
        f"cd {shlex.quote(os.getcwd())}",
    ]
    if nodes is None:
        how = (
            "Each rank was this command, run as a fork of autotune's warm worker process "
            "(which had imported what the command imports; same code, same environment)"
            if spawn == "warm"
            else "What the launcher ran, per rank"
        )
        lines += [
            f"torchrun --standalone --nproc-per-node {spec.num_processes} "
            f"-m autotune.probe.worker {folder}",
            "",
            f"# {how} (RANK/LOCAL_RANK 0.."
            f"{spec.num_processes - 1}, WORLD_SIZE={spec.num_processes}, "
            f"MASTER_ADDR=127.0.0.1, MASTER_PORT={port}):",
            shlex.join(worker),
        ]
    else:
        lines.append(f"# on each node K (0..{nodes.count - 1}: {', '.join(nodes.hosts)}):")
        lines.append(
            f"torchrun --nnodes {nodes.count} --node-rank K --nproc-per-node "
            f"{spec.num_processes} --master-addr {shlex.quote(nodes.master_addr)} "
            f"--master-port {port} -m autotune.probe.worker {folder}"
        )
        lines += [
            "",
            f"# What the launcher ran ({nodes.via}): an agent per node, each "
            "starting that node's ranks (node<K>.json: their exits):",
        ]
        lines += [shlex.join(launch.argv) for launch in launches]
    (probe_dir / "cmd.txt").write_text("\n".join(lines) + "\n")


class ProcessHandle(Protocol):
    """What the launcher needs of a started rank (``subprocess.Popen`` has it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Spawner(Protocol):
    """Starts one rank of a probe, appending its output to the two log files."""

    kind: str
    """``fresh`` (a new interpreter) or ``warm`` (a fork of a process that has imported
    torch): recorded in each probe's result."""

    def spawn(
        self, probe_dir: Path, env: dict[str, str], stdout: Path, stderr: Path, process_group: int
    ) -> ProcessHandle: ...


class SubprocessSpawner:
    """Each rank a fresh interpreter: ``python -m autotune.probe.worker DIR``."""

    kind = "fresh"

    def spawn(
        self, probe_dir: Path, env: dict[str, str], stdout: Path, stderr: Path, process_group: int
    ) -> ProcessHandle:
        with stdout.open("ab") as out, stderr.open("ab") as err:
            return subprocess.Popen(
                worker_command(probe_dir),
                env={**env, PARENT_ENV: str(os.getpid())},
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                process_group=process_group,
            )


@dataclass(kw_only=True)
class Running:
    """The processes of a probe the launcher (or a node agent) started, and their groups."""

    procs: list[ProcessHandle]
    """Ranks on one node; node agents (or the one ``srun``) across nodes."""
    pgids: list[int]
    """The process groups that hold them and whatever they start."""
    killed: set[int]
    """Indices of ``procs`` the launcher signalled."""


def signal_groups(running: Running, sig: int) -> None:
    for pgid in running.pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def stop(running: Running, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the groups, then SIGKILL whatever is still there after ``grace_s``, and every
    process the ranks started outside their groups (ninja's compilers)."""
    strays = descendants(p.pid for p in running.procs if p.poll() is None)
    for index, proc in enumerate(running.procs):
        if proc.poll() is None:
            running.killed.add(index)
    signal_groups(running, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and None in [p.poll() for p in running.procs]:
        time.sleep(0.05)
    signal_groups(running, signal.SIGKILL)
    kill_all(strays)
    for proc in running.procs:
        proc.wait()


def _all_finished(spec: ProbeSpec, probe_dir: Path, tokens: list[str] | None) -> bool:
    """Whether every rank's report, read as the probe reads it (:func:`read_report`), says it
    finished (:meth:`~autotune.probe.report.RankReport.finish`)."""
    for rank in range(spec.world_size):
        token = tokens[rank] if tokens else None
        data, _ = read_report(probe_dir / f"rank{rank}.json", rank, token, spec)
        if data is None or data.get("finished") is not True:
            return False
    return True


def _tail(path: Path, limit: int = 4000) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - limit))
        return handle.read().decode("utf-8", "replace")


def read_report(
    path: Path, rank: int, token: str | None = None, spec: ProbeSpec | None = None
) -> tuple[dict[str, Any] | None, str]:
    """A rank's report, or None and what is wrong with it (missing, empty, not JSON, not the
    worker's format; with the rank's ``token``, a run of the user's job: not signed by the
    measurement layer, or not the timed steps ``spec`` asked for)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"{path.name} cannot be read ({error})"
    if not text.strip():
        return None, f"{path.name} is empty"
    try:
        data = json.loads(text)
    except ValueError as error:
        return None, f"{path.name} is not valid JSON ({error})"
    problem = report_problem(data, rank)
    if problem is not None:
        return None, f"{path.name} is not a rank report: {problem}"
    if token is not None and spec is not None:
        problem = job_report_problem(data, token, spec)
        if problem is not None:
            return None, f"{path.name} is not the measurement layer's ({problem})"
    return data, ""


def _unconcluded(report: dict[str, Any] | None, returncode: int | None) -> str:
    """Why a job's rank that exited by itself with 0 left no measurement, where its report
    has neither the layer's finish nor a failure ("" otherwise): the process ended without
    running its exit (``os._exit``, an ``exec``), so the layer never said how it ended."""
    if report is None or returncode != 0 or report.get("finished") is True:
        return ""
    if report.get("status") != Outcome.OK.value:
        return ""
    return (
        "the job's process ended without the measurement layer's verdict (it left without "
        "running Python's exit: os._exit, or an exec)"
    )


def _write_tokens(spec: ProbeSpec, probe_dir: Path) -> list[str] | None:
    """For a run of the user's job, each rank's token (:data:`~autotune.probe.result.TOKEN_FILE`,
    readable by the owner only), or None for autotune's own worker."""
    if spec.script is None:
        return None
    tokens = [secrets.token_hex(32) for _ in range(spec.world_size)]
    for rank, token in enumerate(tokens):
        where = probe_dir / TOKEN_FILE.format(rank)
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token)
    return tokens


def _slowest(reports: list[dict[str, Any] | None], key: str) -> float | None:
    """The largest of the ranks' ``key`` (the probe waits for its slowest rank)."""
    values = [r[key] for r in reports if r and r.get(key) is not None]
    return max(values) if values else None


def _folder_id(probe_dir: Path) -> tuple[int, int] | None:
    """The folder's device and inode (None once it is gone): a folder deleted, or replaced
    by another of the same name, is not the probe's any more."""
    try:
        info = os.stat(probe_dir)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _prepare(
    spec: ProbeSpec,
    probe_dir: Path,
    port: int,
    spawn: str,
    nodes: Nodes | None,
    launches: list[AgentLaunch],
) -> OutputKeeper:
    """Write the probe's folder (the spec, the command) and open its output pipes."""
    probe_dir.mkdir(parents=True, exist_ok=True)
    for stale in (
        *probe_dir.glob("rank*.json"),
        *probe_dir.glob("node*.json"),
        *probe_dir.glob(TOKEN_FILE.format("*")),
    ):
        stale.unlink()
    (probe_dir / "config.json").write_text(json.dumps(spec.to_dict(), indent=2))
    write_request(probe_dir)  # a test fault, only where the test suite armed this process
    _write_command(spec, probe_dir, port, spawn, nodes, launches)
    return OutputKeeper(probe_dir)


def _folder_failure(spec: ProbeSpec, probe_dir: Path, spawn: str, error: OSError) -> ProbeResult:
    """The result of a probe whose folder could not be written (no rank started; what the
    attempt began to write is removed, and no result.json is written)."""
    tokens = [p.name for p in probe_dir.glob(TOKEN_FILE.format("*"))]
    for name in ("config.json", "cmd.txt", FAULT_FILE, *tokens):
        with contextlib.suppress(OSError):
            (probe_dir / name).unlink()
    fault = folder_fault(probe_dir, error.strerror or str(error))
    return ProbeResult(
        spec=spec,
        probe_dir=probe_dir,
        outcome=Outcome.ERROR,
        stage=Stage.STARTUP,
        message=f"{fault}; no rank was started",
        spawn=spawn,
        device=spec.device,
        tuner_fault=fault,
    )


DISK_FAULTS = tuple(os.strerror(code) for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))
"""What a rank's failure says when the disk under its probe folder, not its configuration,
failed it ("No space left on device", "Disk quota exceeded", "Read-only file system")."""


def disk_fault(probe_dir: Path, *texts: str) -> str | None:
    """The tuner's fault in a failed probe's message or log tail, if one names a disk
    fault: the probe says nothing about its configuration."""
    said = next((d for d in DISK_FAULTS if any(d in text for text in texts)), None)
    return None if said is None else folder_fault(probe_dir, said)


def folder_fault(probe_dir: Path, why: str) -> str:
    """A probe folder that cannot be written, and what to do."""
    return f"the probe folder {probe_dir} cannot be written ({why}): {folder_hint(why)}"


def folder_hint(why: str) -> str:
    """What to do about a trials folder that cannot be made or written, by what the system
    said (``strerror``)."""
    if why in (os.strerror(errno.ENOTDIR), os.strerror(errno.EEXIST)):
        return "a file is in the way: give --trials-dir a folder"
    if why in (os.strerror(errno.EACCES), os.strerror(errno.EPERM), os.strerror(errno.EROFS)):
        return "check its permissions, or choose another --trials-dir"
    return "free space there or choose another --trials-dir"


def _start_ranks(
    spec: ProbeSpec,
    probe_dir: Path,
    port: int,
    spawner: Spawner,
    output: OutputKeeper,
    running: Running,
    mark: str,
) -> None:
    """This node's ranks, in one new process group led by rank 0 (each in ``running`` as
    soon as it is started, so a failure to start the next one stops it), each with the
    probe's ``mark`` in its environment."""
    logs = output.stdout, output.stderr
    for rank in range(spec.num_processes):
        env = {**rank_environment(spec, rank, port), MARK_ENV: mark}
        group = running.pgids[0] if running.pgids else 0
        running.procs.append(spawner.spawn(probe_dir, env, *logs, process_group=group))
        if not running.pgids:
            running.pgids.append(running.procs[0].pid)


def _start_agents(launches: list[AgentLaunch], output: OutputKeeper, running: Running) -> None:
    """Every node's agent (or the ``srun`` that starts them), each in a process group of its
    own; an agent on this machine dies with the launcher, one elsewhere when its ``ssh``
    closes (it watches its standard input, which the launcher holds open)."""
    for launch in launches:
        env = dict(os.environ)
        env.pop(PARENT_ENV, None)
        if not launch.remote:
            env[PARENT_ENV] = str(os.getpid())
        with output.stdout.open("ab") as out, output.stderr.open("ab") as err:
            proc = subprocess.Popen(
                launch.argv,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.PIPE if launch.watch else subprocess.DEVNULL,
                process_group=0,
            )
        if launch.watch and proc.stdin is not None:
            # The agent's environment travels here, not on a command line ``ps`` shows.
            try:
                proc.stdin.write(json.dumps(dict(launch.environment or {})).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                pass  # it is gone already: its exit is the verdict
        running.procs.append(proc)
        running.pgids.append(proc.pid)


def _agent_exits(
    spec: ProbeSpec,
    probe_dir: Path,
    running: Running,
    reports: list[dict[str, Any] | None],
    problems: list[str],
    stderr_tail: str,
) -> tuple[list[RankExit], list[int | None]]:
    """Each rank's exit as its node's agent saw it (``node<K>.json``); where an agent left no
    report (it was killed, or its node was lost), its ranks take the agent's own exit."""
    exits: list[RankExit] = []
    pids: list[int | None] = []
    for node in range(spec.nodes):
        index = min(node, len(running.procs) - 1)  # one srun starts every node's agent
        agent = running.procs[index]
        report = read_node_report(probe_dir / NODE_REPORT.format(node))
        entries = {e.get("rank"): e for e in (report or {}).get("ranks", [])}
        for local in range(spec.num_processes):
            rank = node * spec.num_processes + local
            entry = entries.get(rank, {})
            code = entry.get("returncode") if report is not None else agent.returncode
            exits.append(
                RankExit(
                    rank=rank,
                    returncode=code if isinstance(code, int) else None,
                    report=reports[rank],
                    report_problem=problems[rank],
                    killed_by_launcher=bool(entry.get("killed_by_agent"))
                    or index in running.killed,
                    stderr_tail=stderr_tail,
                )
            )
            pids.append(entry.get("pid"))
    return exits, pids


def _node_fault(
    spec: ProbeSpec,
    probe_dir: Path,
    nodes: Nodes,
    launches: list[AgentLaunch],
    running: Running,
    reports: list[dict[str, Any] | None],
    stderr_tail: str,
) -> str | None:
    """Why a node's agent never started (``ssh`` could not reach its host, ``srun`` was
    refused), or None: a remote launch that failed before its agent or any rank of its
    wrote a word is the node's fault, not the configuration's."""
    for index, (launch, proc) in enumerate(zip(launches, running.procs, strict=False)):
        code = proc.returncode
        if not launch.remote or code in (None, 0) or index in running.killed:
            continue
        served = range(nodes.count) if nodes.via == "srun" else [index]
        ranks = [n * spec.num_processes + r for n in served for r in range(spec.num_processes)]
        reported = any(read_node_report(probe_dir / NODE_REPORT.format(n)) for n in served)
        if reported or any(reports[rank] for rank in ranks):
            continue
        said = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
        host = "the allocation's nodes" if nodes.via == "srun" else nodes.hosts[index]
        why = f": {said[-1]}" if said else ""
        check = (
            "check that sbatch/salloc gave this job those nodes"
            if nodes.via == "srun"
            else f"check that 'ssh {host} true' works from here without a password"
        )
        return (
            f"the node agent on {host} did not start ({launch.argv[0]} exited {code}{why}): {check}"
        )
    return None


def launch_probe(
    spec: ProbeSpec,
    probe_dir: Path,
    *,
    spawner: Spawner | None = None,
    nodes: Nodes | None = None,
    poll_s: float = 0.05,
    on_poll: Callable[[float], None] | None = None,
) -> ProbeResult:
    """Run one probe to completion (or to its timeout) and return its merged result.

    ``spawner`` starts the ranks: fresh interpreters by default, or forks of a
    :class:`~autotune.probe.forkserver.ForkServer` that has already imported torch. A probe
    over several nodes (``spec.nodes``) starts a node agent on each of ``nodes`` instead
    (:mod:`autotune.probe.nodes`; its ranks are fresh interpreters).

    Blocks until every rank is reaped and the process groups are empty. ``on_poll`` is called
    with the elapsed seconds while waiting (for progress displays). A KeyboardInterrupt stops
    the probe's groups before propagating.
    """
    if spec.nodes > 1 and (nodes is None or nodes.count != spec.nodes):
        raise ValueError(f"a probe over {spec.nodes} nodes needs their hosts (got {nodes})")
    across = nodes if spec.nodes > 1 else None
    port = free_port()
    spawner = spawner or SubprocessSpawner()
    kind = spawner.kind if across is None else "fresh"
    launches = [] if across is None else agent_launches(probe_dir, across, port, os.environ)
    try:
        output = _prepare(spec, probe_dir, port, kind, across, launches)
        tokens = _write_tokens(spec, probe_dir)
    except OSError as error:
        return _folder_failure(spec, probe_dir, kind, error)
    mark = new_mark()
    folder = _folder_id(probe_dir)
    started = time.monotonic()
    timed_out = gone = False
    # Agents need the time to stop their ranks before they are killed themselves.
    grace = TERM_GRACE_S if across is None else 2 * TERM_GRACE_S + 1.0
    running = Running(procs=[], pgids=[], killed=set())
    try:
        try:
            if across is None:
                _start_ranks(spec, probe_dir, port, spawner, output, running, mark)
            else:
                _start_agents(launches, output, running)
            procs = running.procs
            failed_at: float | None = None
            finished_at: float | None = None
            look_at = started
            while None in [p.poll() for p in procs]:  # poll each: a later one may have failed
                elapsed = time.monotonic() - started
                if on_poll is not None:
                    on_poll(elapsed)
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if finished_at is None and time.monotonic() >= look_at:
                    look_at = time.monotonic() + FINISH_POLL_S
                    if _all_finished(spec, probe_dir, tokens):
                        finished_at = time.monotonic()
                if _folder_id(probe_dir) != folder:
                    gone = True  # nothing the ranks write can be read back: stop them now
                    stop(running, grace)
                elif elapsed > spec.timeout_s:
                    timed_out = True
                    stop(running, grace)
                elif failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                    stop(running, grace)  # the others wait in a collective the failed rank left
                elif finished_at is not None and time.monotonic() - finished_at > EXIT_GRACE_S:
                    stop(running, grace)  # measured and reported: only their exit hangs
                else:
                    time.sleep(poll_s)
        finally:
            if any(p.poll() is None for p in running.procs):
                stop(running, grace)
            # Anything a rank spawned (compiler jobs, data workers) goes with the probe, in
            # its groups or wherever it went (a session of its own, re-parented to init).
            signal_groups(running, signal.SIGKILL)
            kill_all(marked(mark))
            for proc in running.procs:
                if isinstance(proc, subprocess.Popen) and proc.stdin is not None:
                    with contextlib.suppress(OSError):  # an agent long gone: a broken pipe
                        proc.stdin.close()
    finally:
        output.close()
    wall = time.monotonic() - started
    gone = gone or _folder_id(probe_dir) != folder

    stderr_tail = _tail(probe_dir / "stderr.log")
    read = [
        read_report(probe_dir / f"rank{r}.json", r, tokens[r] if tokens else None, spec)
        if not gone
        else (None, "the probe folder was deleted")
        for r in range(spec.world_size)
    ]
    if tokens is not None and across is None:
        for r, proc in enumerate(running.procs):
            problem = _unconcluded(read[r][0], proc.returncode)
            read[r] = (None, problem) if problem else read[r]
    reports = [report for report, _ in read]
    problems = [problem for _, problem in read]
    if across is None:
        exits = [
            RankExit(
                rank=r,
                returncode=p.returncode,
                report=reports[r],
                report_problem=problems[r],
                killed_by_launcher=r in running.killed,
                stderr_tail=stderr_tail,
            )
            for r, p in enumerate(running.procs)
        ]
        pids: list[int | None] = [p.pid for p in running.procs]
    else:
        exits, pids = _agent_exits(spec, probe_dir, running, reports, problems, stderr_tail)
    verdict = classify_probe(exits, timed_out=timed_out)
    if gone:
        verdict = Classification(
            outcome=Outcome.ERROR,
            message=f"the probe folder {probe_dir} was deleted while the probe ran: its ranks "
            "were stopped and what they measured is lost",
        )
    first_report = reports[0] or next((r for r in reports if r), None) or {}
    result = ProbeResult(
        spec=spec,
        probe_dir=probe_dir,
        outcome=verdict.outcome,
        stage=verdict.stage,
        message=verdict.message,
        failed_rank=verdict.rank,
        sizes=merge_sizes(reports, spec.world_size, verdict),
        wall_s=wall,
        import_s=first_report.get("import_s"),
        startup_s=_slowest(reports, "startup_s"),
        spawn=kind,
        build_s=first_report.get("build_s"),
        device=first_report.get("device") or spec.device,
        gpu_name=first_report.get("gpu_name"),
        peak_flops=first_report.get("peak_flops"),
        num_params=first_report.get("num_params"),
        exits=[
            {
                "rank": e.rank,
                "pid": pid,
                "returncode": e.returncode,
                "killed_by_launcher": e.killed_by_launcher,
                # Stopped after it finished: a teardown that hung, its measurements kept.
                "finished": bool(e.report and e.report.get("finished")),
            }
            for e, pid in zip(exits, pids, strict=True)
        ],
    )
    if result.outcome not in (Outcome.OK, Outcome.OOM):
        result.tuner_fault = disk_fault(probe_dir, result.message, stderr_tail)
        if across is not None:
            result.tuner_fault = result.tuner_fault or _node_fault(
                spec, probe_dir, across, launches, running, reports, stderr_tail
            )
    if not gone:
        write_result(result)
    return result


def write_result(result: ProbeResult) -> None:
    """Write ``result.json``; one that cannot be written is said in the result's message and
    is the tuner's fault (the probe's folder), not the configuration's."""
    try:
        result.write()
    except OSError as error:
        note = f"result.json could not be written ({error.strerror or error})"
        result.message = f"{result.message}; {note}" if result.message else note
        result.tuner_fault = result.tuner_fault or folder_fault(
            result.probe_dir, error.strerror or str(error)
        )

"""One node's part of a multi-node probe: ``python -m autotune.probe.agent DIR ...``.

The launcher starts an agent on every node (:mod:`autotune.probe.nodes` says how). The agent
starts the node's ranks (``num_processes`` of the probe's ``config.json``) as fresh
interpreters in a process group of their own, with torchrun's variables for their place in
the whole world, and supervises them as the launcher does on one node: after one rank fails
the others get :data:`~autotune.probe.launcher.FAILURE_GRACE_S` to write their reports, then
the group is ended. A SIGTERM (the launcher's timeout or Ctrl-C, forwarded by ``srun``), the
end of its standard input with ``--watch-stdin`` (the ``ssh`` that started it is gone; the
first line of that input is the environment the launcher forwards) or its
parent's death ends the ranks too. It then writes ``node<K>.json``: every rank's exact exit
status (a signal as a negative code), which the launcher turns into the probe's verdict as it
does a local rank's. It imports no torch: it only starts and reaps processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from autotune.probe.launcher import (
    FAILURE_GRACE_S,
    Running,
    rank_environment,
    signal_groups,
    stop,
    worker_command,
)
from autotune.probe.lifetime import PARENT_ENV, die_with_parent
from autotune.probe.nodes import NODE_REPORT
from autotune.probe.spec import ProbeSpec

__all__ = ["main", "run"]


def _node_rank(given: int | None) -> int:
    """The node rank given, or Slurm's for this task (one agent task per node)."""
    if given is not None:
        return given
    value = os.environ.get("SLURM_NODEID") or os.environ.get("SLURM_PROCID")
    if value is None:
        raise SystemExit("autotune agent: no --node-rank and no SLURM_NODEID to take it from")
    return int(value)


def _write_report(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2))
    partial.replace(path)


def _read_environment() -> None:
    """Add the environment the launcher sends as the first line of standard input (one JSON
    object of names to values) to this process's, for the ranks to inherit."""
    line = sys.stdin.buffer.readline()
    try:
        received = json.loads(line) if line.strip() else {}
    except ValueError:
        received = {}
    if isinstance(received, dict):
        os.environ.update({str(k): str(v) for k, v in received.items()})


def _watch_stdin(stop_now: threading.Event) -> None:
    """Set ``stop_now`` once standard input ends (the ``ssh`` session is gone)."""
    while True:
        try:
            chunk = sys.stdin.buffer.read1(4096)  # type: ignore[union-attr]
        except (OSError, ValueError):
            break
        if not chunk:
            break
    stop_now.set()


def run(probe_dir: Path, *, node_rank: int, master_addr: str, port: int, watch: bool) -> int:
    """Start this node's ranks, supervise them, write ``node<K>.json``; 0 when every rank
    exited cleanly, 1 otherwise."""
    spec = ProbeSpec.from_dict(json.loads((probe_dir / "config.json").read_text()))
    stop_now = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_now.set())
    signal.signal(signal.SIGINT, lambda *_: stop_now.set())
    if watch:
        _read_environment()
        threading.Thread(target=_watch_stdin, args=(stop_now,), daemon=True).start()
    running = Running(procs=[], pgids=[], killed=set())
    procs = running.procs
    try:
        for local in range(spec.num_processes):
            env = rank_environment(spec, local, port, node_rank=node_rank, master_addr=master_addr)
            proc = subprocess.Popen(
                worker_command(probe_dir),
                env={**env, PARENT_ENV: str(os.getpid())},
                stdin=subprocess.DEVNULL,
                process_group=running.pgids[0] if running.pgids else 0,
            )
            procs.append(proc)
            if not running.pgids:
                running.pgids.append(proc.pid)
        failed_at: float | None = None
        while None in [p.poll() for p in procs]:  # poll each: a later one may have failed
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if stop_now.is_set() or (
                failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S
            ):
                stop(running)
            else:
                time.sleep(0.05)
    finally:
        if any(p.poll() is None for p in procs):
            stop(running)
        signal_groups(running, signal.SIGKILL)  # whatever a rank started goes with it
    first = node_rank * spec.num_processes
    _write_report(
        probe_dir / NODE_REPORT.format(node_rank),
        {
            "node": node_rank,
            "host": socket.gethostname(),
            "pgid": running.pgids[0] if running.pgids else None,
            "ranks": [
                {
                    "rank": first + local,
                    "pid": p.pid,
                    "returncode": p.returncode,
                    "killed_by_agent": local in running.killed,
                }
                for local, p in enumerate(procs)
            ],
        },
    )
    return 0 if all(p.returncode == 0 for p in procs) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.probe.agent")
    parser.add_argument("probe_dir", type=Path)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--node-rank", type=int, default=None)
    parser.add_argument("--watch-stdin", action="store_true")
    args = parser.parse_args(argv)
    parent = os.environ.get(PARENT_ENV)
    if parent:
        die_with_parent(int(parent))
    return run(
        args.probe_dir,
        node_rank=_node_rank(args.node_rank),
        master_addr=args.master_addr,
        port=args.master_port,
        watch=args.watch_stdin,
    )


if __name__ == "__main__":
    sys.exit(main())

"""Where a probe's ranks run when they span several nodes, and how each node's agent starts.

A multi-node probe starts one node agent (:mod:`autotune.probe.agent`) per node; each agent
starts that node's ranks in a process group of its own, supervises them as the launcher does
on one node, and writes ``node<K>.json`` with every rank's exact exit status. The agents reach
their nodes one of three ways:

- ``srun``: inside a Slurm allocation, one ``srun`` step with one task per node (the agents
  take their node rank and the first node's name, where rank 0's rendezvous listens, from
  ``SLURM_NODEID`` and ``SLURM_STEP_NODELIST``). Slurm forwards a SIGTERM to every task and
  ends the whole step when ``srun`` is killed: no rank outlives the probe on any node.
- ``ssh``: on hosts given by ``--hosts`` (the first one is the node the tuner runs on). The
  agent ends its ranks when its standard input closes, that is, when the tuner or its ``ssh``
  goes away.
- ``local``: a host that is this machine (``localhost``, a loopback address, this host's name)
  gets its agent as a child process, in a process group of its own.

The rendezvous is torch.distributed's TCP store on the first node (``MASTER_ADDR`` and
``MASTER_PORT``, the static rendezvous torchrun uses with ``--master-addr``): the tuner picks
a free port there, which is why the first host must be the tuner's own. Probe folders must be
on a file system every node sees (ranks write ``rank<N>.json`` there, agents ``node<K>.json``).
Everything here is pure but :func:`is_local_host`, which looks at this host's names.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import ConfigError

__all__ = [
    "NODE_REPORT",
    "AgentLaunch",
    "Nodes",
    "agent_launches",
    "check_host",
    "expand_hostlist",
    "is_local_host",
    "nodes_from_environment",
    "read_node_report",
]

VIAS = ("local", "ssh", "srun")
NODE_REPORT = "node{}.json"
"""A node agent's report in the probe folder, by node rank: each of its ranks' exits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Nodes:
    """The hosts a multi-node probe runs on, and how its agents reach them."""

    hosts: tuple[str, ...]
    """One per node, in node-rank order; the first holds rank 0 and the rendezvous."""
    via: str = "local"
    """``srun`` (one step over a Slurm allocation), ``ssh`` or ``local``, per :data:`VIAS`."""

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError("a multi-node probe needs at least one host")
        if self.via not in VIAS:
            raise ConfigError(f"unknown way to reach nodes {self.via!r}: use one of {VIAS}")

    @property
    def count(self) -> int:
        return len(self.hosts)

    @property
    def master_addr(self) -> str:
        """Where rank 0's rendezvous listens (loopback when the first host is this one and
        every node is: no interface outside the machine is needed)."""
        first = self.hosts[0]
        if self.via == "local" and all(_loopback(h) for h in self.hosts):
            return "127.0.0.1"
        return first


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as host names: ``gpu[01-03,07],login1`` is ``gpu01``,
    ``gpu02``, ``gpu03``, ``gpu07``, ``login1`` (zero padding kept; several bracket groups
    in one name multiply out, as ``scontrol show hostnames`` does).

    Raises:
        ConfigError: An unbalanced bracket or a range that is not ``N`` or ``N-M``.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if item:
            hosts.extend(_expand_one(item, text))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return items


def _expand_one(item: str, whole: str) -> list[str]:
    opened = item.find("[")
    if opened < 0:
        if "]" in item:
            raise ConfigError(f"host list {whole!r}: unbalanced ']' in {item!r}")
        return [item]
    closed = item.find("]", opened)
    if closed < 0:
        raise ConfigError(f"host list {whole!r}: unbalanced '[' in {item!r}")
    prefix, ranges, rest = item[:opened], item[opened + 1 : closed], item[closed + 1 :]
    numbers: list[str] = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ConfigError(f"host list {whole!r}: {part!r} is not a number or a range N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    tails = _expand_one(rest, whole) if rest else [""]
    return [f"{prefix}{n}{tail}" for n in numbers for tail in tails]


_HOST = re.compile(
    r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])"
)
"""A host as ``ssh`` and ``srun`` take it: a name or an address (IPv6 in brackets), with an
optional ``user@``. Nothing that starts with ``-`` (an option to ``ssh``) or holds a space,
a quote, a line break or a shell character: the whole text must match (``fullmatch``; a
``$`` would match before a trailing newline)."""


def check_host(host: str) -> str:
    """``host``, when it is a host name or address.

    Raises:
        ConfigError: Anything else: an option in disguise (``-oProxyCommand=...``), an empty
            name, spaces or shell characters.
    """
    if len(host) > 255 or _HOST.fullmatch(host) is None:
        raise ConfigError(
            f"{host!r} is not a host name: use names or addresses like node2, 10.0.0.2 or "
            "user@node2, separated by commas"
        )
    return host


def _loopback(host: str) -> bool:
    return host == "localhost" or re.fullmatch(r"127(\.\d{1,3}){3}", host) is not None


def is_local_host(host: str) -> bool:
    """``host`` is this machine: ``localhost``, a loopback address, or one of its names."""
    if _loopback(host):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return host in names or host.split(".")[0] == socket.gethostname().split(".")[0]


def nodes_from_environment(
    environ: Mapping[str, str], *, nodes: int | None, hosts: Sequence[str] | None
) -> Nodes | None:
    """The nodes a run's probes span: ``hosts`` as given (reached by ``ssh``, or directly
    where a host is this machine), else the Slurm allocation the tuner runs in (all its nodes,
    or the first ``nodes``), else None (one node, this one).

    Raises:
        ConfigError: ``nodes`` larger than the hosts or the allocation, or above 1 with
            neither; a host list that repeats a host it reaches by ``ssh``.
    """
    if hosts:
        hosts = tuple(check_host(host) for host in hosts)
        wanted = nodes if nodes is not None else len(hosts)
        if wanted > len(hosts):
            raise ConfigError(
                f"--nodes {wanted}, but --hosts names {len(hosts)}: name a host per node"
            )
        chosen = hosts[:wanted]
        if wanted > 1 and not is_local_host(chosen[0]):
            raise ConfigError(
                f"--hosts starts with {chosen[0]}, but rank 0 and its rendezvous run where "
                "the tuner runs: put this host first"
            )
        remote = [h for h in chosen if not is_local_host(h)]
        if len(set(remote)) != len(remote):
            raise ConfigError(f"--hosts names a host twice ({', '.join(remote)}): one per node")
        if wanted == 1:
            return None
        return Nodes(hosts=chosen, via="ssh" if remote else "local")
    allocation = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if environ.get("SLURM_JOB_ID") and allocation:
        listed = [check_host(host) for host in expand_hostlist(allocation)]
        wanted = nodes if nodes is not None else len(listed)
        if wanted > len(listed):
            raise ConfigError(
                f"--nodes {wanted}, but this Slurm allocation has {len(listed)} node"
                f"{'s' if len(listed) > 1 else ''}: ask sbatch for more, or use --nodes "
                f"{len(listed)}"
            )
        return Nodes(hosts=tuple(listed[:wanted]), via="srun") if wanted > 1 else None
    if nodes is not None and nodes > 1:
        raise ConfigError(
            f"--nodes {nodes} needs the hosts: run inside a Slurm allocation (sbatch/salloc), "
            "or name them with --hosts this-host,node2,..."
        )
    return None


FORWARDED_PREFIXES = ("TORCH_", "NCCL_", "GLOO_", "OMP_", "PYTHONPATH", "HF_")
"""The variables an agent started by ``ssh`` gets from the tuner's environment (``ssh``
passes none; ``srun`` passes all): what the ranks read. None of autotune's own: the ranks
never need the storage URL, and the launcher's parent pid is this host's."""


def forwarded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What of the tuner's environment an agent on another host needs: where DeepSpeed's ops
    live, the CUDA arch list, NCCL's and gloo's settings. It travels on the ``ssh`` session's
    standard input, never on a command line (which ``ps`` shows on both hosts)."""
    return {key: value for key, value in environ.items() if key.startswith(FORWARDED_PREFIXES)}


def agent_command(
    probe_dir: Path, nodes: Nodes, port: int, node_rank: int | None, *, watch: bool = False
) -> list[str]:
    """One node agent's command (``node_rank`` None: taken from ``SLURM_NODEID``)."""
    command = [sys.executable, "-m", "autotune.probe.agent", str(probe_dir)]
    command += ["--master-addr", nodes.master_addr, "--master-port", str(port)]
    if node_rank is not None:
        command += ["--node-rank", str(node_rank)]
    if watch:
        command.append("--watch-stdin")
    return command


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentLaunch:
    """How the launcher starts one process that brings up agents."""

    argv: list[str]
    remote: bool
    """It reaches other hosts (``srun``, ``ssh``): the launcher's parent pid is not passed."""
    watch: bool = False
    """The agent watches its standard input (``ssh``): the launcher holds it open."""
    environment: Mapping[str, str] | None = None
    """What the launcher writes to a watching agent's standard input first, as one JSON line:
    the variables the agent adds to its own environment (:func:`forwarded_environment`)."""


def agent_launches(
    probe_dir: Path, nodes: Nodes, port: int, environ: Mapping[str, str]
) -> list[AgentLaunch]:
    """What the launcher runs to start every node's agent: one ``srun`` step for all nodes
    (one task per node), or one command per node: the agent itself for this machine, ``ssh
    -- HOST ...`` for another (the remote command is one string for its shell, every word
    quoted; the forwarded environment goes on the session's standard input)."""
    if nodes.via == "srun":
        srun = ["srun", f"--nodes={nodes.count}", f"--ntasks={nodes.count}"]
        srun += ["--ntasks-per-node=1", f"--nodelist={','.join(nodes.hosts)}"]
        srun += ["--kill-on-bad-exit=1", "--export=ALL"]
        return [AgentLaunch(argv=srun + agent_command(probe_dir, nodes, port, None), remote=True)]
    launches = []
    for rank, host in enumerate(nodes.hosts):
        if is_local_host(host):
            launches.append(
                AgentLaunch(argv=agent_command(probe_dir, nodes, port, rank), remote=False)
            )
            continue
        command = agent_command(probe_dir, nodes, port, rank, watch=True)
        remote = f"cd {shlex.quote(str(Path.cwd()))} && exec {shlex.join(command)}"
        launches.append(
            AgentLaunch(
                argv=["ssh", "-o", "BatchMode=yes", "--", host, remote],
                remote=True,
                watch=True,
                environment=forwarded_environment(environ),
            )
        )
    return launches


def read_node_report(path: Path) -> dict[str, Any] | None:
    """A node agent's report, or None when it is missing or unreadable (the agent was
    killed, or its node lost)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        return None
    return data

"""DeepSpeed's JIT-built ops: which a probe loads, where they are built, and building them once.

DeepSpeed compiles some of its C++/CUDA ops the first time a process loads them, through
``torch.utils.cpp_extension`` (into ``$TORCH_EXTENSIONS_DIR/<op>/<op>.so``): the CPU
shared-memory communication op on the CPU (40-120 s on 2 cores), CPU Adam (optimizer
offload; 76 s on an H100 node) and fused Adam on GPUs. This module lets the tuner build them as
a step of its own, outside any probe's timeout, and makes a killed build harmless:

- torch guards each op's build (and each load, which checks the build) with a ``lock`` file
  that it creates, keeps open and deletes; a process killed meanwhile leaves it, and every
  later load of the op waits on it forever (torch's wait has no bound). Everything here that
  loads or builds an op first takes an ``flock`` on ``$TORCH_EXTENSIONS_DIR/autotune-ops.lock``,
  which the kernel releases when its holder dies: exclusive to build (or to clear such a
  lock), shared merely to load a built op. The measurement layer of a user's script loads the
  ops it knows the job's DeepSpeed will load the same way, before the script runs.
- A torch lock is removed only when it is provably stale (:func:`settle_torch_lock`): this
  process holds the exclusive flock, so no autotune process anywhere is loading or building
  an op, and no process this host shows has the file open (torch's holder keeps it open from
  creating it to deleting it) for :data:`TORCH_LOCK_GRACE_S` on end. What else can hold one is
  a process outside autotune's lock: a user's script loading an op autotune did not know it
  would, or a training run sharing the folder. Autotune waits for such a holder, and every
  wait here on a torch lock, torch's own included (:func:`load_ops` bounds it), ends after
  its bound with one line that names the file. A holder the check cannot see (another
  user's process, or one on another host sharing the folder) keeps the lock: the wait then
  ends with a line saying so.
- DeepSpeed's builder parses ``TORCH_CUDA_ARCH_LIST`` with ``int()`` on each
  ``major.minor``, so arch-specific suffixes torch accepts (``9.0a``, ``10.0f``) fail every
  build; :func:`normalize_arch_list` rewrites the list into the form it parses.

Nothing here imports torch or DeepSpeed at module level: the tuner uses the pure parts, and
only :func:`load_ops` (in a rank, or in ``python -m autotune.probe.ops build``) loads them.

The build step runs as ``python -m autotune.probe.ops build OP ...`` (``__main__.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from autotune.config import Engine, Offload, TrainConfig

__all__ = [
    "ARCH_LIST_ENV",
    "BUILDERS",
    "BUILD_WAIT_S",
    "EXTENSIONS_ENV",
    "LOCK_NAME",
    "TORCH_LOCK_GRACE_S",
    "BuildLockTimeout",
    "OpLoad",
    "bounded_torch_waits",
    "build_command",
    "build_lock",
    "deepspeed_ops",
    "environment_ninja",
    "extensions_dir",
    "library_path",
    "load_ops",
    "lock_holders",
    "normalize_arch_list",
    "op_environment",
    "pending_ops",
    "settle_torch_lock",
    "torch_lock_holders",
    "torch_lock_path",
]

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"
LOCK_NAME = "autotune-ops.lock"
"""The flock file in the extensions directory (never deleted: its inode is the lock)."""
BUILD_WAIT_S = 900.0
"""How long the build step waits for another process's build before giving up."""
TORCH_LOCK_GRACE_S = 1.0
"""How long a torch lock must be seen with no process holding it open before it counts as
left by a killed process: torch's holder closes the file a moment before deleting it."""

SHM_COMM = "deepspeed_shm_comm"
CPU_ADAM = "cpu_adam"
FUSED_ADAM = "fused_adam"
BUILDERS: dict[str, str] = {
    SHM_COMM: "ShareMemCommBuilder",
    CPU_ADAM: "CPUAdamBuilder",
    FUSED_ADAM: "FusedAdamBuilder",
}
"""The ops a probe can load, and the class DeepSpeed's accelerator builds each with."""

_ARCH = re.compile(r"(?P<major>\d+)\.(?P<minor>\d+)[a-z]*(?P<ptx>\+PTX)?")


# ---------------------------------------------------------------------------------------------
# Pure: what to build, where, with which environment


def normalize_arch_list(value: str) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder parses, or None if nothing
    in it names an architecture (the variable is then best left unset: the build targets the
    visible GPUs, which is what ``native`` asks for).

    DeepSpeed reads each entry as ``major.minor`` with an optional ``+PTX``, calling ``int()``
    on both numbers. Entries torch also accepts are rewritten: an arch-specific suffix is
    dropped (``9.0a`` → ``9.0``, ``10.0f+PTX`` → ``10.0+PTX``), entries for the same
    ``major.minor`` merge into one (with ``+PTX`` if any of them had it), in the order of
    first appearance; entries that name no numbered architecture (``native``, ``Hopper``) are
    dropped. Spaces and semicolons both separate entries; the result uses semicolons.
    """
    archs: dict[tuple[int, int], bool] = {}
    for entry in value.replace(";", " ").split():
        match = _ARCH.fullmatch(entry)
        if match is None:
            continue
        key = int(match["major"]), int(match["minor"])
        archs[key] = archs.get(key, False) or match["ptx"] is not None
    if not archs:
        return None
    return ";".join(
        f"{major}.{minor}{'+PTX' if ptx else ''}" for (major, minor), ptx in archs.items()
    )


def deepspeed_ops(config: TrainConfig, device: str) -> tuple[str, ...]:
    """The JIT-built ops a DeepSpeed probe of ``config`` loads on ``device`` (``cpu`` or a GPU).

    On the CPU, DeepSpeed's accelerator builds its shared-memory communication op whenever
    DeepSpeed's communication backend starts (one rank or several); the probes' optimizer is
    torch's AdamW (``torch_adam``), so no Adam op. On GPUs the communication is NCCL, and the
    optimizer is DeepSpeed's CPU Adam when optimizer states are offloaded, its fused Adam
    otherwise. Other engines load none.
    """
    if config.engine is not Engine.DEEPSPEED:
        return ()
    if device == "cpu":
        return (SHM_COMM,)
    return (CPU_ADAM,) if config.offload is not Offload.NONE else (FUSED_ADAM,)


def extensions_dir(env: Mapping[str, str]) -> Path:
    """Where torch builds extensions for processes with environment ``env``: the user's
    ``TORCH_EXTENSIONS_DIR``, else one folder per Python environment (``sys.prefix``).

    torch's own default, ``~/.cache/torch_extensions``, is keyed by op name only: two virtual
    environments would rebuild (and race on) each other's builds.
    """
    return Path(env.get(EXTENSIONS_ENV) or Path(sys.prefix) / "torch_extensions")


def environment_ninja() -> Path | None:
    """The ``ninja`` installed beside this interpreter (pip's ``ninja``, which DeepSpeed
    requires), if there is one."""
    ninja = Path(sys.executable).parent / "ninja"
    return ninja if ninja.is_file() and os.access(ninja, os.X_OK) else None


def op_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a process that may build DeepSpeed ops needs it: the extensions folder set
    (:func:`extensions_dir`); the environment's own ``ninja`` first on ``PATH``
    (:func:`environment_ninja`); and ``TORCH_CUDA_ARCH_LIST``, where set, normalized for
    DeepSpeed (:func:`normalize_arch_list`; removed when it names no architecture).

    torch builds an op by running the ``ninja`` on ``PATH``, and ninja rebuilds everything
    when the build log was written by a ninja of another log format: a system ninja (1.11)
    and pip's (1.13) rebuild each other's ops. The environment's own is the one its users'
    jobs find once it is activated (an exported run), so the ops built here are theirs too.
    """
    out = dict(env)
    out[EXTENSIONS_ENV] = str(extensions_dir(env))
    ninja = environment_ninja()
    if ninja is not None:
        folders = [f for f in out.get("PATH", "").split(os.pathsep) if f]
        if not folders or folders[0] != str(ninja.parent):
            out["PATH"] = os.pathsep.join([str(ninja.parent), *folders])
    if ARCH_LIST_ENV in out:
        arch_list = normalize_arch_list(out[ARCH_LIST_ENV])
        if arch_list is None:
            del out[ARCH_LIST_ENV]
        else:
            out[ARCH_LIST_ENV] = arch_list
    return out


def library_path(directory: Path, op: str) -> Path:
    """The shared library torch builds for ``op`` in the extensions folder ``directory``."""
    return directory / op / f"{op}.so"


def torch_lock_path(directory: Path, op: str) -> Path:
    """The file torch holds while building ``op`` (left behind by a killed build)."""
    return directory / op / "lock"


def pending_ops(ops: Iterable[str], directory: Path) -> list[str]:
    """The ops that need the build step: not built yet, or with a torch lock present (a build
    in progress, or one that was killed). Reads the folder only; imports nothing."""
    return [
        op
        for op in ops
        if not library_path(directory, op).is_file() or torch_lock_path(directory, op).exists()
    ]


def build_command(
    ops: Sequence[str], directory: Path, *, wait_s: float = BUILD_WAIT_S
) -> list[str]:
    """The command that builds ``ops`` into ``directory`` in a process of its own."""
    return [
        sys.executable,
        "-m",
        "autotune.probe.ops",
        "build",
        "--dir",
        str(directory),
        "--wait",
        repr(wait_s),
        *ops,
    ]


# ---------------------------------------------------------------------------------------------
# The build lock


class BuildLockTimeout(RuntimeError):
    """Another live process held the build lock for longer than the wait allowed."""


def lock_holders(path: Path) -> list[int]:
    """Pids holding an ``flock`` on ``path`` (from ``/proc/locks``; empty where unreadable)."""
    try:
        inode = path.stat().st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2b:1837 0 EOF" (a "->" marks a blocked waiter)
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5].rsplit(":", 1)[-1] == str(inode) and fields[4].isdigit():
            pids.append(int(fields[4]))
    return pids


def _describe(pid: int) -> str:
    """``pid 4242 (python -m autotune.probe.worker ...)``, as far as /proc tells."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    command = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a)
    if len(command) > 80:
        command = command[:77] + "..."
    return f"pid {pid} ({command})" if command else f"pid {pid}"


@contextlib.contextmanager
def build_lock(
    directory: Path,
    *,
    exclusive: bool,
    wait_s: float | None,
    say: Callable[[str], None] = print,
    poll_s: float = 0.2,
) -> Iterator[None]:
    """Hold the extensions folder's ``flock``: ``exclusive`` to build, shared to load.

    Waits while another process holds it in a conflicting mode, saying so once; raises
    :class:`BuildLockTimeout` after ``wait_s`` seconds (None: no bound). The kernel drops the
    lock when its holder dies, so it is never stale.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        started = time.monotonic()
        waiting = False
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            holders = ", ".join(_describe(p) for p in lock_holders(path) if p != os.getpid())
            held_by = f", held by {holders}" if holders else ""
            if not waiting:
                bound = "" if wait_s is None else f" (up to {wait_s:g} s)"
                say(
                    f"waiting for another process building DeepSpeed ops in {directory}"
                    f"{held_by}{bound}"
                )
                waiting = True
            if wait_s is not None and time.monotonic() - started > wait_s:
                raise BuildLockTimeout(
                    f"gave up after {wait_s:g} s waiting for the DeepSpeed op build lock "
                    f"{path}{held_by}: run again once it is done, or stop it"
                )
            time.sleep(poll_s)
        yield
    finally:
        os.close(fd)  # closing the only descriptor releases the flock


# ---------------------------------------------------------------------------------------------
# torch's build lock of one op


def torch_lock_holders(lock: Path) -> list[int] | None:
    """Pids of the processes that have torch's build lock ``lock`` open (from each process's
    ``/proc/<pid>/fd``); None where that cannot be told: no ``/proc``, or the file belongs to
    another user, whose processes this one may not inspect (root inspects every process)."""
    try:
        info = lock.stat()
    except FileNotFoundError:
        return []
    if info.st_uid != os.geteuid() and os.geteuid() != 0:
        return None
    key = (info.st_dev, info.st_ino)
    pids = []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            fds = list(os.scandir(f"/proc/{entry.name}/fd"))
        except OSError:  # ended, or not inspectable (then not the file's owner's)
            continue
        for fd in fds:
            try:
                if not os.readlink(fd.path).endswith(lock.name):
                    continue
                opened = os.stat(fd.path)
            except OSError:
                continue
            if (opened.st_dev, opened.st_ino) == key:
                pids.append(int(entry.name))
                break
    return pids


def _end_orphans(folder: Path) -> int:
    """End the processes still working in an op's build folder (their working directory):
    ninja starts each compiler in a process group of its own, so killing a probe's group
    leaves them running, writing objects that would make the next build's outputs look out
    of date. Only for a stale torch lock under the exclusive build lock, where they belong to
    no live build. Returns how many there were."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if Path(proc.cwd()) == folder:
                found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return len(found)


def settle_torch_lock(
    lock: Path,
    *,
    may_remove: bool,
    wait_s: float | None,
    say: Callable[[str], None] = print,
    poll_s: float = 0.2,
    grace_s: float = TORCH_LOCK_GRACE_S,
) -> None:
    """Return once torch's build lock ``lock`` is gone.

    A live holder (a process with the file open) is waited for, saying so once with the file
    and the holder. ``may_remove`` (the caller holds the exclusive build lock): a lock no
    process has had open for ``grace_s`` was left by a killed process; it is removed, with
    one warning that names it, after ending the compilers its build left running. Without
    ``may_remove``, or with a holder the check cannot see (:func:`torch_lock_holders`), it is
    waited for too. Raises :class:`BuildLockTimeout` after ``wait_s`` seconds (None: no
    bound but the caller's, a probe's timeout), in one line that names the file.
    """
    op = lock.parent.name
    started = time.monotonic()
    unheld_since: float | None = None
    said = False
    while True:
        try:
            owner = lock.stat().st_uid
        except FileNotFoundError:
            return
        holders = torch_lock_holders(lock)
        now = time.monotonic()
        if holders == []:
            unheld_since = now if unheld_since is None else unheld_since
            if may_remove and now - unheld_since >= grace_s:
                orphans = _end_orphans(lock.parent.resolve())
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                    ended = f"; ended {orphans} of its compiler processes" if orphans else ""
                    say(
                        f"warning: removed a stale lock {lock} (left by a process killed while "
                        f"loading or building {op}: no process has it open, and autotune "
                        f"holds its build lock{ended})"
                    )
                return
        else:
            unheld_since = None
        if holders is None:
            who = f"created by uid {owner}, whose processes this user cannot see"
            advice = f"delete it once no build of {op} runs"
        elif holders:
            who = "held by " + ", ".join(_describe(p) for p in holders)
            advice = "run again once it is done, or stop it"
        else:
            who = "which no process holds (left by a killed process)"
            advice = "autotune's next build step removes it, or delete it"
        removing = may_remove and holders == []  # within the grace: bounded by it alone
        if not said and not removing:
            bound = "" if wait_s is None else f" (up to {wait_s:g} s)"
            say(f"waiting for torch's build lock {lock}, {who}{bound}")
            said = True
        if wait_s is not None and now - started >= wait_s and not removing:
            raise BuildLockTimeout(
                f"gave up after {wait_s:g} s waiting for torch's build lock {lock}, {who}: {advice}"
            )
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------
# Loading and building (imports torch and DeepSpeed: ranks and the build step only)


@dataclass(frozen=True, kw_only=True, slots=True)
class OpLoad:
    """What loading one op did."""

    op: str
    action: str
    """``built`` (its library written now), ``loaded`` (already built), ``skipped`` (not used
    by DeepSpeed's accelerator here)."""
    seconds: float
    note: str = ""

    def line(self) -> str:
        if self.action == "skipped":
            return f"{self.op}: skipped ({self.note})"
        return f"{self.op}: {self.action} in {self.seconds:.1f} s"


def _modified(path: Path) -> int | None:
    """``path``'s modification time in nanoseconds; None if it does not exist."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def bounded_torch_waits(
    *, may_remove: bool, wait_s: float | None, say: Callable[[str], None]
) -> Iterator[None]:
    """While this process loads ops, torch's own wait on an op's build lock (``FileBaton.wait``:
    it polls until the file is gone, without end) is :func:`settle_torch_lock`, with its
    bound and its one line. It is reached only when a lock appeared after the one checked
    before loading (another process's load that began meanwhile)."""
    from torch.utils.file_baton import FileBaton

    original = FileBaton.wait

    def wait(self: FileBaton) -> None:
        lock = Path(self.lock_file_path)
        settle_torch_lock(lock, may_remove=may_remove, wait_s=wait_s, say=say)

    FileBaton.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileBaton.wait = original  # type: ignore[method-assign]


def load_ops(
    ops: Sequence[str],
    directory: Path,
    *,
    wait_s: float | None,
    say: Callable[[str], None] = print,
) -> list[OpLoad]:
    """Load ``ops`` into this process through DeepSpeed's op builders, building what is
    missing, under the build lock (:func:`build_lock`).

    The lock is exclusive when an op needs building or has a torch lock (removed when stale,
    waited for while a live process holds it: :func:`settle_torch_lock`), shared otherwise.
    Every wait, for the build lock or a torch lock, ends after ``wait_s`` seconds (None: the
    caller's own bound, a probe's timeout). Loading registers each op with DeepSpeed, so its
    own later loads in this process reuse it without touching torch's lock. An op DeepSpeed's
    accelerator here has no builder for, or whose builder says it cannot run here, is skipped
    (DeepSpeed skips it too). ``directory`` must be this process's ``TORCH_EXTENSIONS_DIR``.
    """
    if not ops:
        return []
    todo = set(pending_ops(ops, directory))
    loads = []
    exclusive = bool(todo)
    with build_lock(directory, exclusive=exclusive, wait_s=wait_s, say=say):
        for op in sorted(todo):
            lock = torch_lock_path(directory, op)
            settle_torch_lock(lock, may_remove=True, wait_s=wait_s, say=say)
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        with bounded_torch_waits(may_remove=exclusive, wait_s=wait_s, say=say):
            for op in ops:
                builder = accelerator.create_op_builder(BUILDERS[op])
                if builder is None or not builder.is_compatible(verbose=False):
                    note = f"DeepSpeed's {accelerator.device_name()} accelerator does not use it"
                    loads.append(OpLoad(op=op, action="skipped", seconds=0.0, note=note))
                    continue
                before = _modified(library_path(directory, op))
                started = time.monotonic()
                builder.load(verbose=False)
                seconds = time.monotonic() - started
                after = _modified(library_path(directory, op))
                action = "loaded" if before is not None and before == after else "built"
                loads.append(OpLoad(op=op, action=action, seconds=seconds))
    return loads

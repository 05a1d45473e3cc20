"""A fork server: import torch and transformers once, then start each probe rank by ``fork``.

A fresh probe process spends most of its start-up importing torch, transformers and the
engine (about 4 s of 5 s for a tiny model on the CPU). The fork server is one long-lived
process that has done those imports; each rank is a ``fork`` of it and starts in a fraction
of a second. ``autotune run`` starts one per run (:class:`WarmWorkers`); the tests and
benches share one too.

Two things make a warm process unfit to fork from, and the server checks both:

- **CUDA initialized.** A CUDA context does not survive a fork: a child of a process that
  initialized the driver fails at its first CUDA call. The server never touches CUDA (torch's
  availability checks go through NVML, ``PYTORCH_NVML_BASED_CUDA_CHECK``), and asks the
  driver itself whether anything initialized it (:func:`cuda_driver_initialized`) after its
  imports and before every fork. DeepSpeed's import probes the accelerator: on a GPU host it
  is preloaded only if that leaves the driver untouched, otherwise the server is restarted
  without it and each rank imports DeepSpeed itself. The model families' modules are
  preloaded the same way: where torchao is installed they import it, and its import reads
  the GPU's compute capability through the driver; the server then starts again without
  them (and without DeepSpeed), and each rank imports its model's module itself.
- **Stale code.** The server's modules were imported when it started; if a file of one of
  them changed since (autotune or a library upgraded during a long run), a fork would run the
  old code. :meth:`ForkServer.stale` compares every loaded module file's size and modification
  time with those at start-up (about 3,000 files, 15 ms).

Protocol: JSON lines over a socket pair. The client sends ``{"spawn": {...}}``; the server
forks, puts the child in the requested process group, and answers ``{"pid": N}`` (or
``{"refused": why}``); when a child exits it sends ``{"exit": N, "returncode": R}``
(negative R: killed by signal -R). ``{"check": true}`` is answered ``{"stale": why or null}``.
The server lives until the client closes the socket. Not thread-safe: one client, one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.probe.launcher import Spawner, SubprocessSpawner
from autotune.probe.lifetime import PARENT_ENV, die_with_parent

PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "transformers",
    "autotune.probe.worker",
    "autotune.probe.engines.ddp",
    "autotune.probe.engines.fsdp",
)
"""Modules every rank needs; imported once by the server."""
MODEL_PRELOAD = (
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gpt2.modeling_gpt2",
)
"""The model families' modules, imported once too where that leaves CUDA alone: where torchao
is installed they import it, and its import asks the driver for the compute capability."""
DEEPSPEED_OPTIMIZER_CHECK = "deepspeed.runtime.zero.muon.muon_optimizer"
"""What DeepSpeed's optimizer check imports in every engine, in the versions that have it."""


class ForkServerError(RuntimeError):
    """The fork server could not start or stopped answering."""


# ---------------------------------------------------------------------------------------------
# Server side (runs in the fork-server process)


_PRELOAD_MODES = ("always", "never", "try", "bare")
"""What the server preloads beyond :data:`PRELOAD`: the model modules (:data:`MODEL_PRELOAD`)
and DeepSpeed (``always``), the model modules alone (``never``), DeepSpeed only if its import
left CUDA alone (``try``, a GPU host), or neither (``bare``)."""
RESTART_WITHOUT_DEEPSPEED = "importing DeepSpeed initialized CUDA"
"""The error a ``try`` server ends with when DeepSpeed cannot be preloaded on this host."""
RESTART_WITHOUT_MODELS = "importing the model modules initialized CUDA"
"""The error a server ends with when the model modules cannot be preloaded here (it is
started again ``bare``)."""
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Environment variables read at import time: a change makes the warm process stale."""


def cuda_driver_initialized() -> bool:
    """Whether the CUDA driver has been initialized in this process (False without a driver).

    Every driver call but a few answers ``CUDA_ERROR_NOT_INITIALIZED`` (3) before ``cuInit``:
    ``cuDeviceGetCount`` succeeding means some import already initialized it. Loading the
    library does not initialize it.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(libcuda.cuDeviceGetCount(ctypes.byref(count))) == 0


def _cuda_touched() -> str | None:
    """Why forked ranks could not use CUDA, or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialized CUDA in the warm process"
    if cuda_driver_initialized():
        return "the CUDA driver was initialized in the warm process"
    return None


def _module_files() -> dict[str, tuple[int, int]]:
    """Every loaded module's file, with its size and modification time."""
    files: dict[str, tuple[int, int]] = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or path in files:
            continue
        with contextlib.suppress(OSError):
            info = os.stat(path)
            files[path] = (info.st_size, info.st_mtime_ns)
    return files


def _changed(files: dict[str, tuple[int, int]]) -> str | None:
    """The first loaded module file that changed since ``files`` was taken, or None."""
    for path, (size, mtime) in files.items():
        try:
            info = os.stat(path)
        except OSError:
            return f"{path} was removed"
        if (info.st_size, info.st_mtime_ns) != (size, mtime):
            return f"{path} changed"
    return None


def _preload(mode: str, extra: Sequence[str] = ()) -> None:
    # Availability checks through NVML: they must not initialize the driver here.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in (*PRELOAD, *extra):
        importlib.import_module(name)
    problem = _cuda_touched()
    if problem is not None:
        raise ForkServerError(f"{problem} while preloading: forked ranks could not use it")
    if mode == "bare":
        return
    for name in MODEL_PRELOAD:
        importlib.import_module(name)
    if _cuda_touched() is not None:
        raise ForkServerError(RESTART_WITHOUT_MODELS)
    if mode == "never":
        return
    importlib.import_module("deepspeed")
    # deepspeed.initialize imports this module on every engine (its optimizer check), and its
    # import builds torch.compile's machinery: about 2 s a DeepSpeed rank when each does it.
    with contextlib.suppress(ImportError):
        importlib.import_module(DEEPSPEED_OPTIMIZER_CHECK)
    if mode == "try" and _cuda_touched() is not None:
        raise ForkServerError(RESTART_WITHOUT_DEEPSPEED)


def _exec_child(request: dict[str, Any], server_sock: socket.socket, server: int) -> None:
    """In the forked child: become the rank, run the worker, never return."""
    code = 1
    try:
        die_with_parent(server)
        server_sock.close()
        os.setpgid(0, request["process_group"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request.get("script"):  # the user's own training script, as its own __main__
            from autotune.probe import userjob

            code = userjob.run_warm(Path(request["probe_dir"]), request["script"])
        else:
            from autotune.probe import worker

            code = worker.main([request["probe_dir"]])
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def serve(sock: socket.socket, *, mode: str, extra: Sequence[str] = ()) -> None:
    """Serve spawn requests on ``sock`` until the client goes away."""
    try:
        _preload(mode, extra)
    except BaseException as error:
        _send(sock, {"error": f"{error}" if isinstance(error, ForkServerError) else
                     f"{type(error).__name__}: {error}"})  # fmt: skip
        return
    files = _module_files()
    # What the imports made lives as long as the ranks: out of every collection. A rank's
    # collections (the memory meter's, before each size) then walk only its own objects,
    # not the millions torch and transformers made, and write to none of their pages (no
    # copy-on-write of the server's heap): 0.25 s less a micro-batch size on the CPU.
    gc.collect()
    gc.freeze()
    _send(sock, {"ready": True, "deepspeed": "deepspeed" in sys.modules,
                 "models": MODEL_PRELOAD[0] in sys.modules})  # fmt: skip
    buffer = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.02)
        if readable:
            chunk = sock.recv(65536)
            if not chunk:
                break  # the client is gone: so are the server and its children
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if "check" in message:
                    _send(sock, {"stale": _cuda_touched() or _changed(files)})
                    continue
                problem = _cuda_touched()
                if problem is not None:
                    _send(sock, {"refused": problem})
                    continue
                request = message["spawn"]
                sys.stdout.flush()
                sys.stderr.flush()
                server = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _exec_child(request, sock, server)
                # Also set the group from the parent, so it is in place before the answer.
                with contextlib.suppress(OSError):
                    os.setpgid(pid, request["process_group"] or pid)
                children.add(pid)
                _send(sock, {"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, {"exit": pid, "returncode": _returncode(status)})


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fd, mode, extra = int(args[0]), args[1], args[2:]
    if mode not in _PRELOAD_MODES:
        print(f"usage: python -m autotune.probe.forkserver FD {{{','.join(_PRELOAD_MODES)}}} "
              "[MODULE...]", file=sys.stderr)  # fmt: skip
        return 2
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent else None)  # the tuner's end is the server's end
    serve(socket.socket(fileno=fd), mode=mode, extra=extra)
    return 0


# ---------------------------------------------------------------------------------------------
# Client side (runs in the tuner)


class ForkedProcess:
    """A rank started by the fork server: the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self._server.pump(wait_s=0.02)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """Client of one fork-server process; use as a context manager.

    Args:
        with_deepspeed: Preload DeepSpeed too. Default: on a host without a GPU, yes; on a
            GPU host, only if its import leaves CUDA uninitialized (else the server is
            started again without it).
        preload: More modules to import once (beyond :data:`PRELOAD`).
        log: Where the server's own output goes (its imports' warnings); default: this
            process's. A forked rank writes to its probe's logs.
        preload_models: Preload the model families' modules (:data:`MODEL_PRELOAD`) too;
            False starts the server as it restarts where their import initializes CUDA
            (neither they nor DeepSpeed preloaded).
    """

    kind = "warm"
    """How the ranks start (``cmd.txt`` and each result say it)."""

    def __init__(
        self,
        *,
        with_deepspeed: bool | None = None,
        preload: Sequence[str] = (),
        log: Path | None = None,
        preload_models: bool = True,
    ) -> None:
        self._log = log
        if not preload_models:
            mode = "bare"
        elif with_deepspeed is None:
            from autotune.hardware import detect_gpus

            mode = "always" if detect_gpus() is None else "try"
        else:
            mode = "always" if with_deepspeed else "never"
        self._buffer = b""
        self._live: dict[int, ForkedProcess] = {}
        self.env = {key: os.environ.get(key) for key in ENV_KEYS}
        """The environment it started in (the parts imports read)."""
        try:
            reply = self._start(mode, preload)
            restart = {RESTART_WITHOUT_DEEPSPEED: "never", RESTART_WITHOUT_MODELS: "bare"}
            if reply.get("error") in restart:
                self.close()
                reply = self._start(restart[reply["error"]], preload)
        except BaseException:  # a Ctrl-C while it imports, or no answer
            self.close()
            raise
        if "error" in reply or not reply.get("ready"):
            self.close()
            raise ForkServerError(f"fork server did not start: {reply.get('error', reply)}")
        self.deepspeed = bool(reply.get("deepspeed"))
        """Whether DeepSpeed is preloaded."""
        self.models = bool(reply.get("models"))
        """Whether the model families' modules are preloaded (:data:`MODEL_PRELOAD`)."""

    def _start(self, mode: str, preload: Sequence[str]) -> dict[str, Any]:
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._buffer = b""
        output = self._log.open("ab") if self._log is not None else None
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.probe.forkserver",
                str(theirs.fileno()),
                mode,
                *preload,
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            process_group=0,  # a Ctrl-C in the terminal is the tuner's to handle, not ours
        )
        theirs.close()
        if output is not None:
            output.close()
        return self._receive(timeout_s=300.0)

    @property
    def pid(self) -> int:
        """The server process's pid."""
        return self._process.pid

    def stale(self) -> str | None:
        """Why forking from this server would not give what a fresh rank gets (a loaded
        module's file changed, CUDA got initialized in it, the environment changed, it
        exited), or None."""
        for key, value in self.env.items():
            if os.environ.get(key) != value:
                return f"{key} changed"
        try:
            _send(self._sock, {"check": True})
            reply = self._receive(timeout_s=60.0)
        except (OSError, ForkServerError) as error:
            return f"the warm process stopped answering ({error})"
        return reply.get("stale")

    def spawn(
        self,
        probe_dir: Path,
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        process_group: int,
        *,
        script: Sequence[str] = (),
    ) -> ForkedProcess:
        """Fork one rank running the probe worker on ``probe_dir``, or the user's training
        ``script`` (its path and arguments) under the measurement layer."""
        request = {
            "probe_dir": str(probe_dir),
            "env": env,
            "stdout": str(stdout),
            "stderr": str(stderr),
            "process_group": process_group,
            "cwd": os.getcwd(),
            "script": list(script),
        }
        try:
            _send(self._sock, {"spawn": request})
        except OSError as error:
            raise ForkServerError(f"the fork server is gone: {error}") from None
        reply = self._receive(timeout_s=60.0)
        if "refused" in reply:
            raise ForkServerError(f"the fork server refused to fork: {reply['refused']}")
        handle = ForkedProcess(self, int(reply["pid"]))
        self._live[handle.pid] = handle
        return handle

    def pump(self, wait_s: float = 0.0) -> None:
        """Read exit reports that have arrived (waiting up to ``wait_s`` for the first)."""
        readable, _, _ = select.select([self._sock], [], [], wait_s)
        if not readable:
            return
        try:
            chunk = self._sock.recv(65536)
        except OSError:  # reset: it died
            chunk = b""
        if not chunk:
            self._orphan_all()
            return
        self._buffer += chunk
        self._dispatch_lines()

    def _dispatch_lines(self) -> dict[str, Any] | None:
        """Route exit reports to their handles; return the first other message, if any."""
        other = None
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message and message["exit"] in self._live:
                self._live.pop(message["exit"]).returncode = int(message["returncode"])
            elif other is None:
                other = message
            else:
                raise ForkServerError(f"unexpected message from the fork server: {message}")
        return other

    def _receive(self, *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._dispatch_lines()
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._sock], [], [], remaining)[0]:
                raise ForkServerError("the fork server did not answer in time")
            try:
                chunk = self._sock.recv(65536)
            except OSError:  # reset: it died
                chunk = b""
            if not chunk:
                raise ForkServerError("the fork server exited")
            self._buffer += chunk

    def _orphan_all(self) -> None:
        # The server died: its children can no longer be reaped by us. Report the ones that
        # are gone as killed, so no caller waits forever.
        for pid, handle in list(self._live.items()):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                handle.returncode = -signal.SIGKILL
                self._live.pop(pid)

    def close(self) -> None:
        """Stop the server (ranks already started are not affected)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout=10)
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WarmWorkers:
    """The warm process a tuning run forks its probe ranks from, with fresh interpreters as
    the fallback.

    Started by a set-up step of the run (its imports take seconds: 4 s on a 2-core CPU), then
    checked before every probe (:meth:`ForkServer.stale`) and started again when stale. If it
    cannot start, or fails to fork, the rest of the run starts its ranks as fresh
    interpreters (:attr:`off` says why).

    Args:
        with_deepspeed: As for :class:`ForkServer`.
        preload: As for :class:`ForkServer`.
    """

    def __init__(self, *, with_deepspeed: bool | None = None, preload: Sequence[str] = ()) -> None:
        self._with_deepspeed = with_deepspeed
        self._preload = tuple(preload)
        self._server: ForkServer | None = None
        self._log: Path | None = None
        self.off: str | None = None
        """Why ranks start as fresh interpreters for the rest of the run (None: they fork)."""

    def pending(self) -> str | None:
        """What must happen before the next probe can fork its ranks (``starting ...``,
        ``restarting ...: why``), or None: ready, or off."""
        if self.off is not None:
            return None
        if self._server is None:
            return "starting warm probe workers"
        stale = self._server.stale()
        return None if stale is None else f"restarting warm probe workers: {stale}"

    def start(self) -> str:
        """Start (or start again) the warm process; returns one line on how it went (and
        turns warm workers off for the run if it failed)."""
        self.close()
        handle, name = tempfile.mkstemp(prefix="autotune-warm-", suffix=".log")
        os.close(handle)
        self._log = Path(name)
        try:
            self._server = ForkServer(
                with_deepspeed=self._with_deepspeed, preload=self._preload, log=self._log
            )
        except ForkServerError as error:
            self.off = f"{error} (its output: {self._log})"
            self._log = None  # kept for the user to read
            return f"{self.off}: ranks start as fresh interpreters"
        with_ds = " and DeepSpeed" if self._server.deepspeed else ""
        models = ""
        if not self._server.models:
            models = " (not the model modules, whose import initialized CUDA: each rank's own)"
        return f"torch, transformers{with_ds} imported once{models}; ranks fork from it"

    @property
    def pid(self) -> int | None:
        """The warm process's pid, while it runs."""
        return self._server.pid if self._server is not None else None

    @property
    def spawner(self) -> Spawner:
        """How the next probe starts its ranks."""
        if self._server is None or self.off is not None:
            return SubprocessSpawner()
        return self._server

    def give_up(self, why: str) -> None:
        """Fall back to fresh interpreters for the rest of the run."""
        self.off = why
        self.close()

    def close(self) -> None:
        """Stop the warm process, if one runs (a later :meth:`pending` asks to start one)."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None


if __name__ == "__main__":
    sys.exit(main())

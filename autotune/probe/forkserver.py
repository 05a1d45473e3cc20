"""A fork server: import torch and transformers once, then start each probe rank by ``fork``.

A fresh probe process spends most of its start-up importing torch, transformers and the
engine (about 4 s of 5 s for a tiny model on the CPU). The fork server is one long-lived
process that has done those imports; each rank is a ``fork`` of it and starts in a fraction
of a second. It never touches CUDA before forking (a CUDA context does not survive a fork):
it checks ``torch.cuda.is_initialized()`` after its imports and refuses to serve if anything
did, and DeepSpeed, whose import probes the accelerator, is preloaded only on CPU-only hosts.

Protocol: JSON lines over a socket pair. The client sends ``{"spawn": {...}}``; the server
forks, puts the child in the requested process group, and answers ``{"pid": N}``; when a
child exits it sends ``{"exit": N, "returncode": R}`` (negative R: killed by signal -R). The
server lives until the client closes the socket. Not thread-safe: one client, one thread.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from autotune.probe.lifetime import PARENT_ENV, die_with_parent

PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gpt2.modeling_gpt2",
    "autotune.probe.worker",
    "autotune.probe.engines.ddp",
    "autotune.probe.engines.fsdp",
)
"""Modules every rank needs; imported once by the server."""


class ForkServerError(RuntimeError):
    """The fork server could not start or stopped answering."""


# ---------------------------------------------------------------------------------------------
# Server side (runs in the fork-server process)


def _preload(with_deepspeed: bool) -> None:
    for name in PRELOAD + (("deepspeed",) if with_deepspeed else ()):
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        raise ForkServerError(
            "CUDA was initialized while preloading: forked ranks could not use it"
        )


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


def serve(sock: socket.socket, *, with_deepspeed: bool) -> None:
    """Serve spawn requests on ``sock`` until the client goes away."""
    try:
        _preload(with_deepspeed)
    except BaseException as error:
        _send(sock, {"error": f"{type(error).__name__}: {error}"})
        return
    _send(sock, {"ready": True})
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
                request = json.loads(line)["spawn"]
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
    fd, with_deepspeed = int(args[0]), args[1] == "1"
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent else None)  # the tuner's end is the server's end
    serve(socket.socket(fileno=fd), with_deepspeed=with_deepspeed)
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
        with_deepspeed: Preload DeepSpeed too (only safe where no GPU is visible: its import
            probes the accelerator). Default: when NVML finds no GPU.
    """

    def __init__(self, *, with_deepspeed: bool | None = None) -> None:
        if with_deepspeed is None:
            from autotune.hardware import detect_gpus

            with_deepspeed = detect_gpus() is None
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._buffer = b""
        self._live: dict[int, ForkedProcess] = {}
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.probe.forkserver",
                str(theirs.fileno()),
                "1" if with_deepspeed else "0",
            ],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            process_group=0,  # a Ctrl-C in the terminal is the tuner's to handle, not ours
        )
        theirs.close()
        reply = self._receive(timeout_s=300.0)
        if "error" in reply or not reply.get("ready"):
            self.close()
            raise ForkServerError(f"fork server did not start: {reply.get('error', reply)}")

    def spawn(
        self, probe_dir: Path, env: dict[str, str], stdout: Path, stderr: Path, process_group: int
    ) -> ForkedProcess:
        """Fork one rank running the probe worker on ``probe_dir``."""
        request = {
            "probe_dir": str(probe_dir),
            "env": env,
            "stdout": str(stdout),
            "stderr": str(stderr),
            "process_group": process_group,
            "cwd": os.getcwd(),
        }
        _send(self._sock, {"spawn": request})
        reply = self._receive(timeout_s=60.0)
        handle = ForkedProcess(self, int(reply["pid"]))
        self._live[handle.pid] = handle
        return handle

    def pump(self, wait_s: float = 0.0) -> None:
        """Read exit reports that have arrived (waiting up to ``wait_s`` for the first)."""
        readable, _, _ = select.select([self._sock], [], [], wait_s)
        if not readable:
            return
        chunk = self._sock.recv(65536)
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
            chunk = self._sock.recv(65536)
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


if __name__ == "__main__":
    sys.exit(main())

"""A probe's stdout.log and stderr.log, capped: the head and the tail of what its ranks wrote.

A rank that floods its output (a warning in a loop, a debug dump) must fill neither the disk
nor the tuner's memory. So ranks do not write to the log files: each stream of a probe is a
named pipe in its folder (``.stdout.pipe``, ``.stderr.pipe``, there only while the probe
runs) that every rank opens in place of the file, and a thread of the launcher drains both
into the logs. Each log keeps the first :data:`HEAD_BYTES` and the last :data:`TAIL_BYTES` of
the probe's output on that stream; one line between them says how much was dropped. The head
is written as it arrives; the tail is held in memory and written when the probe ends. A rank
that writes faster than the thread drains waits in its ``write`` (the pipe's back-pressure),
as it would on a slow disk.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from pathlib import Path
from typing import BinaryIO

__all__ = ["HEAD_BYTES", "TAIL_BYTES", "CappedLog", "OutputKeeper"]

HEAD_BYTES = 1 << 20
"""How much of a probe's output on one stream its log keeps from the start (1 MiB)."""
TAIL_BYTES = 1 << 20
"""How much it keeps from the end (1 MiB)."""
_CHUNK = 1 << 16
_FINAL_DRAIN_S = 1.0
"""After the ranks are gone, how long what is left in the pipes is read (a process they
started that lives on and writes could otherwise keep the launcher)."""


def _size_text(count: int) -> str:
    if count >= 1 << 20:
        return f"{count / (1 << 20):.1f} MiB"
    return f"{count} bytes"


class CappedLog:
    """Appends to ``path`` the first ``head`` bytes written to it and, on :meth:`close`, the
    last ``tail`` (with a line saying how many bytes between them were dropped)."""

    def __init__(self, path: Path, *, head: int = HEAD_BYTES, tail: int = TAIL_BYTES) -> None:
        self.path = path
        self.head = head
        self.tail = tail
        self.written = 0
        """Bytes of the head written so far."""
        self.dropped = 0
        """Bytes neither in the head nor in the tail."""
        self.total = 0
        """Bytes written to this log in all."""
        self._file: BinaryIO | None = path.open("ab", buffering=0)
        self._tail = bytearray()

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head - self.written
        if room > 0:
            first = data[:room]
            self._write(first)
            self.written += len(first)
            data = data[room:]
        if not data:
            return
        if len(data) >= self.tail:
            self.dropped += len(self._tail) + len(data) - self.tail
            self._tail = bytearray(data[len(data) - self.tail :])
            return
        self._tail += data
        excess = len(self._tail) - self.tail
        if excess > 0:
            self.dropped += excess
            del self._tail[:excess]

    def _write(self, data: bytes) -> None:
        if self._file is None or not data:
            return
        try:
            self._file.write(data)
        except OSError:  # a full disk: the log stops, the probe does not
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Write the tail (after the line saying what was dropped, if anything was)."""
        if self.dropped:
            self._write(
                f"\n[autotune: {_size_text(self.dropped)} of output dropped here; "
                f"{self.path.name} keeps the first {_size_text(self.head)} and the last "
                f"{_size_text(self.tail)} of a probe's output]\n".encode()
            )
        self._write(bytes(self._tail))
        self._tail = bytearray()
        if self._file is not None:
            self._file.close()
            self._file = None


class OutputKeeper:
    """The two named pipes of a probe and the thread that drains them into capped logs.

    Ranks open :attr:`stdout` and :attr:`stderr` (the pipes) as they would open the logs.
    :meth:`close` (after the ranks are reaped) drains what is left, writes the logs' tails and
    removes the pipes. The keeper holds a write end of each pipe itself, so a pipe no rank
    has open yet (or any more) reads as empty, never as ended.

    Raises:
        OSError: The pipes cannot be made in ``probe_dir``, or the logs not opened.
    """

    def __init__(self, probe_dir: Path, *, head: int = HEAD_BYTES, tail: int = TAIL_BYTES):
        self.stdout = probe_dir / ".stdout.pipe"
        self.stderr = probe_dir / ".stderr.pipe"
        self.logs: dict[int, CappedLog] = {}
        self._fds: list[int] = []
        self._stop = threading.Event()
        try:
            for pipe, log in ((self.stdout, "stdout.log"), (self.stderr, "stderr.log")):
                pipe.unlink(missing_ok=True)  # left by a launcher that was killed
                os.mkfifo(pipe, 0o600)
                read = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
                self._fds.append(read)
                self._fds.append(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
                self.logs[read] = CappedLog(probe_dir / log, head=head, tail=tail)
        except OSError:
            self._release()
            raise
        self._thread = threading.Thread(target=self._drain, name="probe-output", daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> bool:
        """Move one chunk from the pipe to its log; False when the pipe is empty."""
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return False
        if not data:
            return False
        self.logs[fd].write(data)
        return True

    def _drain(self) -> None:
        readers = list(self.logs)
        while not self._stop.is_set():
            ready, _, _ = select.select(readers, [], [], 0.1)
            for fd in ready:
                self._read(fd)

    def close(self) -> None:
        """Stop draining, read what is left, write the tails, remove the pipes."""
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + _FINAL_DRAIN_S
        for fd in self.logs:
            while time.monotonic() < deadline and self._read(fd):
                pass
        self._release()

    def _release(self) -> None:
        for log in self.logs.values():
            log.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        for pipe in (self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                pipe.unlink()

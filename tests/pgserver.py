"""A private PostgreSQL server for the tests: its own data folder, loopback only, trust auth.

``PostgresServer`` runs ``initdb`` into a fresh temporary folder, starts the server on a free
127.0.0.1 port with ``pg_ctl -w start`` (its unix socket stays inside the folder), creates
databases on request, and on ``stop`` ends it with ``pg_ctl -m immediate stop`` and removes the
folder. PostgreSQL refuses to run as root, so under root the folder belongs to the ``postgres``
user and the server commands run as that user; otherwise as the current user.

Durability is switched off (``fsync``, ``synchronous_commit``, ``full_page_writes``): the data
lives only as long as the test session.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["INSTALL_HINT", "PostgresServer", "find_bindir"]

INSTALL_HINT = "install them with `apt-get install postgresql` (Debian/Ubuntu)"
SERVER_TOOLS = ("initdb", "pg_ctl", "postgres")
SERVER_USER = "postgres"
"""Who owns the data folder and runs the server when the tests run as root."""


def _has_server_tools(bindir: Path) -> bool:
    return all(os.access(bindir / tool, os.X_OK) for tool in SERVER_TOOLS)


def _version_key(bindir: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", Path(bindir).parent.name))


def find_bindir() -> Path | None:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``, or None where they are missing.

    Looked for with ``pg_config --bindir``, then in Debian's ``/usr/lib/postgresql/*/bin``
    (newest major version first), then on ``PATH``.
    """
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        done = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False, timeout=30
        )
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    candidates.extend(Path(p) for p in debian)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    return next((c for c in candidates if _has_server_tools(c)), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """One private server; ``start()`` then ``url(database)``; ``stop()`` removes everything."""

    def __init__(self, bindir: Path, *, superuser: str = "postgres") -> None:
        self.bindir = bindir
        self.superuser = superuser
        self.root: Path | None = None
        self.port: int | None = None
        self._owner: pwd.struct_passwd | None = None

    @property
    def data_dir(self) -> Path:
        assert self.root is not None, "the server is not started"
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        assert self.root is not None, "the server is not started"
        return self.root / "server.log"

    def url(self, database: str) -> str:
        """A SQLAlchemy URL for one database, with the psycopg (3) driver."""
        assert self.port is not None, "the server is not started"
        return f"postgresql+psycopg://{self.superuser}@127.0.0.1:{self.port}/{database}"

    def _run(self, args: Sequence[str], *, as_owner: bool = True) -> None:
        """Run one PostgreSQL program (as the folder's owner where the tests run as root)."""
        assert self.root is not None
        kwargs: dict[str, Any] = {}
        if as_owner and self._owner is not None:
            kwargs.update(user=self._owner.pw_uid, group=self._owner.pw_gid, extra_groups=[])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            "HOME": str(self.root),
        }
        done = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            **kwargs,
        )
        if done.returncode != 0:
            log = self.log_file.read_text()[-2000:] if self.log_file.exists() else ""
            raise RuntimeError(
                f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
                + (f"\n--- server log ---\n{log}" if log else "")
            )

    def start(self, *, attempts: int = 3) -> PostgresServer:
        """initdb into a fresh folder and start the server on a free loopback port."""
        self.root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
        try:
            if os.geteuid() == 0:
                try:
                    self._owner = pwd.getpwnam(SERVER_USER)
                except KeyError:
                    raise RuntimeError(
                        f"PostgreSQL refuses to run as root and there is no {SERVER_USER!r} "
                        f"user to run it as; {INSTALL_HINT} (it creates the user)"
                    ) from None
                os.chown(self.root, self._owner.pw_uid, self._owner.pw_gid)
            self._run(
                [
                    "initdb",
                    "--pgdata",
                    str(self.data_dir),
                    "--username",
                    self.superuser,
                    "--auth",
                    "trust",
                    "--encoding",
                    "UTF8",
                    "--no-locale",
                    "--no-sync",
                ]
            )
            # Only the folder's socket and 127.0.0.1 can reach the server.
            (self.data_dir / "pg_hba.conf").write_text(
                "local all all trust\nhost all all 127.0.0.1/32 trust\n"
            )
            with (self.data_dir / "postgresql.conf").open("a") as conf:
                conf.write(
                    "\n# autotune tests\n"
                    "listen_addresses = '127.0.0.1'\n"
                    f"unix_socket_directories = '{self.root}'\n"
                    "fsync = off\n"
                    "synchronous_commit = off\n"
                    "full_page_writes = off\n"
                    "max_connections = 200\n"
                )
            for attempt in range(attempts):
                self.port = _free_port()
                try:
                    self._run(
                        ["pg_ctl", "--pgdata", str(self.data_dir), "--log", str(self.log_file),
                         "--options", f"-p {self.port}", "--wait", "--timeout", "60", "start"]
                    )  # fmt: skip
                    break
                except RuntimeError:
                    # Another process may have taken the port between the probe and the bind.
                    if attempt == attempts - 1:
                        raise
            return self
        except BaseException:
            self.stop()
            raise

    def create_database(self, name: str) -> str:
        """Create a database and return its URL."""
        assert self.port is not None
        self._run(
            ["createdb", "--host", "127.0.0.1", "--port", str(self.port),
             "--username", self.superuser, name],
            as_owner=False,
        )  # fmt: skip
        return self.url(name)

    def pause(self) -> None:
        """Stop the server as an outage would (``pg_ctl -m fast stop``), keeping its data."""
        self._run(["pg_ctl", "--pgdata", str(self.data_dir), "--mode", "fast", "--wait", "stop"])

    def resume(self) -> None:
        """Start the paused server again on the same port."""
        assert self.port is not None
        self._run(
            ["pg_ctl", "--pgdata", str(self.data_dir), "--log", str(self.log_file),
             "--options", f"-p {self.port}", "--wait", "--timeout", "60", "start"]
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the server at once (``pg_ctl -m immediate stop``) and remove its folder."""
        if self.root is None:
            return
        pid_file = self.data_dir / "postmaster.pid"
        if pid_file.exists():
            try:
                self._run(["pg_ctl", "--pgdata", str(self.data_dir), "--mode", "immediate",
                           "--wait", "stop"])  # fmt: skip
            except (RuntimeError, subprocess.TimeoutExpired):
                _kill_postmaster(pid_file)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        self.port = None


def _kill_postmaster(pid_file: Path) -> None:
    """The last resort when pg_ctl cannot stop the server: SIGQUIT, then SIGKILL."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    for sig in (signal.SIGQUIT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

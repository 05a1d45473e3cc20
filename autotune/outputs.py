"""The files a command writes where the user points it (``-o``): an export, a report.

An output is written whole or not at all, never over a file without ``--force``, and never
in place of something that is not a regular file: a symbolic link, a folder or a block
device is refused, and a stream (a character device such as ``/dev/null`` or ``/dev/stdout``,
a FIFO) is written into, as a shell's ``>`` would, since nothing in it is replaced. A file
replaced with ``--force`` keeps its mode (and, where the process may set it, its owner).

Pure of torch; the CLI and the API call :func:`check_output` before any work and
:func:`write_new_file` at the end.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from autotune.config import ConfigError

__all__ = ["check_output", "write_new_file"]


def _exists(path: Path) -> ConfigError:
    return ConfigError(f"{path} exists: add --force to overwrite it, or pick another -o")


def _cannot(path: Path, error: OSError) -> ConfigError:
    why = error.strerror or str(error)
    if error.errno == errno.ENAMETOOLONG:
        longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
        return ConfigError(
            f"cannot write {_short(path)}: {why} (a name of {longest} bytes): pick a shorter -o"
        )
    return ConfigError(f"cannot write {_short(path)}: {why}")


def _short(path: Path) -> str:
    """``path`` as shown in a one-line message (a very long name abridged)."""
    text = str(path)
    return text if len(text) <= 80 else f"{text[:40]}...{text[-30:]}"


def check_output(path: Path, *, force: bool = False) -> bool:
    """Check that ``path`` may take an output; True when it is a stream to write into (a
    character device or a FIFO), False for a regular file to create or replace.

    Raises:
        ConfigError: One line saying what to do, for an existing file without ``force``, a
            symbolic link, a folder, a block device or socket, or a name the file system
            refuses (too long, a missing folder).
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise ConfigError(
                f"cannot write {_short(path)}: its folder {_short(path.parent)} does not "
                "exist: make it, or pick another -o"
            ) from None
        return False
    except OSError as error:
        raise _cannot(path, error) from None
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return True
    if stat.S_ISLNK(mode):
        raise ConfigError(
            f"{_short(path)} is a symbolic link (to {os.readlink(path)}): autotune does not "
            "write through links; give -o the file itself, or another name"
        )
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{_short(path)} is a folder: give -o a file name")
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"{_short(path)} is not a regular file (a block device or a socket): give -o a file"
        )
    if not force:
        raise _exists(path)
    return False


def write_new_file(path: Path, text: str, *, force: bool = False) -> None:
    """Write an output file (``-o``) whole or not at all: the text goes to a temporary file
    beside it, which then takes the name (a link, which fails on an existing file, unless
    ``force``; a rename with it, after taking the replaced file's mode and owner). An
    existing file is never overwritten without ``force``, even one that appeared since it
    was last checked, and a full disk leaves no empty or partial file behind. A stream
    (``/dev/stdout``, a FIFO) is written into.

    Raises:
        ConfigError: As :func:`check_output`, or when the file cannot be written.
    """
    path = Path(path)
    if check_output(path, force=force):
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
            with open(descriptor, "w", encoding="utf-8") as stream:
                stream.write(text)
        except OSError as error:
            raise _cannot(path, error) from None
        return
    # A short name of its own: one derived from the output's could pass the name's limit.
    temporary = path.with_name(f".autotune-{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            if force:
                _keep_mode_and_owner(path, file.fileno())
            os.fsync(file.fileno())
        if force:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # atomic, and refuses an existing name
    except FileExistsError:
        raise _exists(path) from None
    except OSError as error:
        raise _cannot(path, error) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


def _keep_mode_and_owner(path: Path, descriptor: int) -> None:
    """Give the new file behind ``descriptor`` the mode, owner and group of the regular file
    ``path`` it replaces (the owner where this process may set it: as root)."""
    try:
        old = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(old.st_mode):
        return
    os.fchmod(descriptor, stat.S_IMODE(old.st_mode))
    with contextlib.suppress(PermissionError):
        os.fchown(descriptor, old.st_uid, old.st_gid)

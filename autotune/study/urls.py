"""Storage URLs: checked before anything is opened, and never shown with their password.

A storage URL may carry a password (``postgresql://tuner:secret@db/autotune``). Every text
autotune prints or writes that holds a URL (the live view's header, errors, ``--json``)
goes through :func:`masked`, which keeps the user and the host and replaces the password
with ``***``. Nothing else of the URL is stored: trials, probe folders and reports hold the
study's name, never the URL.

Pure: no SQLAlchemy, no Optuna.
"""

from __future__ import annotations

import re

from autotune.config import ConfigError

__all__ = ["check_storage_url", "masked"]

_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):(?P<secret>[^/?#@]*)@")
"""``scheme://user:password@``: the password is what lies between the first colon after the
user and the last ``@`` before the host (a password's own ``@`` is percent-encoded)."""

_FORMS = "sqlite:///path/to.db (a file) or postgresql://user:password@host/database"


def masked(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***`` (the rest kept as given)."""
    return _PASSWORD.sub(lambda m: f"{m['head']}:***@", url, count=1)


def check_storage_url(url: str) -> None:
    """Refuse what cannot be a trial storage before anything is opened or created.

    Raises:
        ConfigError: One line saying what to use, for text that is not a URL (a bare path
            gets the ``sqlite:///`` form it meant), and for an in-memory SQLite database,
            whose trials would be lost when the run ends.
    """
    if "://" not in url:
        hint = f"sqlite:///{url}" if url.endswith((".db", ".sqlite", ".sqlite3")) else _FORMS
        raise ConfigError(f"{masked(url)!r} is not a storage URL: use {hint}")
    scheme, _, rest = url.partition("://")
    if scheme.startswith("sqlite") and rest.partition("?")[0] in ("", "/", "/:memory:"):
        raise ConfigError(
            f"{masked(url)!r} is an in-memory database: every trial would be lost when the run "
            "ends; use sqlite:///path/to.db"
        )

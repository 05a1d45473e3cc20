"""Storage URLs: checked before anything is opened, and never shown with their password.

A storage URL may carry secrets: a password in its user part
(``postgresql://tuner:secret@db/autotune``) or in its query, as libpq and SQLAlchemy accept
them (``?password=...``, ``?sslpassword=...``, a ``passfile`` or ``sslkey`` path). Every text
autotune prints or writes that holds a URL (the live view's header, a job's label, errors,
``--json``) goes through :func:`masked`, which keeps the user, the host and the harmless
query fields and replaces each secret with ``***``; :func:`redact` removes the same secrets
from any other text (a driver's error message that quotes the URL). Nothing else of the URL
is stored: trials, probe folders and reports hold the study's name, never the URL.

Pure: no SQLAlchemy, no Optuna.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from autotune.config import ConfigError

__all__ = ["check_storage_url", "masked", "redact"]

_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):(?P<secret>[^/?#@]*)@")
"""``scheme://user:password@``: the password is what lies between the first colon after the
user and the last ``@`` before the host (a password's own ``@`` is percent-encoded)."""

_FORMS = "sqlite:///path/to.db (a file) or postgresql://user:password@host/database"


_SECRET_FIELD = re.compile(r"pass|secret|token|sslkey|credential|auth", re.IGNORECASE)
"""Query fields that hold a secret or name a file of secrets: libpq's ``password``,
``passfile``, ``sslpassword`` and ``sslkey``, and any driver's ``*token*``, ``*secret*``,
``*auth*`` or ``*credential*``."""
_QUERY_FIELD = re.compile(r"""(?P<head>[?&;](?P<key>[^=&;#\s]+)=)(?P<value>[^&;#\s,'"]*)""")


def masked(url: str) -> str:
    """``url`` with every secret in it replaced by ``***``: the password of its user part and
    the value of each secret query field (the rest kept as given)."""
    url = _PASSWORD.sub(lambda m: f"{m['head']}:***@", url, count=1)
    base, mark, query = url.partition("?")
    if not mark:
        return url
    query = _QUERY_FIELD.sub(
        lambda m: f"{m['head']}***" if _SECRET_FIELD.search(unquote(m["key"])) else m[0],
        "?" + query,
    )
    return base + query


def _secrets(url: str) -> list[str]:
    """The secret values ``url`` holds, as written and decoded (longest first)."""
    found = []
    password = _PASSWORD.match(url)
    if password and password["secret"]:
        found.append(password["secret"])
    _, _, query = url.partition("?")
    for field in _QUERY_FIELD.finditer("?" + query):
        if field["value"] and _SECRET_FIELD.search(unquote(field["key"])):
            found.append(field["value"])
    values = {v for secret in found for v in (secret, unquote(secret)) if v}
    return sorted(values, key=len, reverse=True)


def redact(text: str, url: str) -> str:
    """``text`` (a driver's error, say) with ``url`` masked and every secret of ``url`` that
    it quotes in another form replaced by ``***``."""
    text = text.replace(url, masked(url))
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return masked(text)


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

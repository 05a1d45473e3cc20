"""URLs: storage URLs checked before anything is opened, and no URL shown with its secrets.

A URL may carry secrets: a password in its user part (``postgresql://tuner:secret@db/autotune``)
or in its query, as libpq and SQLAlchemy accept them (``?password=...``, ``?sslpassword=...``,
a ``passfile`` or ``sslkey`` path). What is a secret is what SQLAlchemy's own parser
(:func:`sqlalchemy.engine.make_url`) reads as one, whatever characters it holds: the user
part's password runs from the first ``:`` after the user to the next ``@`` (``/``, ``?`` and
``#`` included), a query field's value to the next ``&`` (``,`` and ``#`` included). A
password with an ``@`` of its own that is not percent-encoded is cut there by SQLAlchemy (the
rest of it becomes the host's name, and the URL connects nowhere); all of it, up to the host's
last ``@``, is masked.

Every text autotune prints or writes that holds a URL (the live view's header, a job's label,
errors, ``--json``) goes through :func:`masked`, which keeps the user, the host and the harmless
query fields as given and replaces each secret with ``***``; :func:`redact` removes the same
secrets, in every spelling, from any other text (a driver's error message that quotes the URL,
decoded or not). Nothing else of a storage URL is stored: trials, probe folders and reports hold
the study's name, never the URL. The arguments of a user's script that are URLs with a secret
are found (:func:`holds_secret`) and masked the same way
(:func:`autotune.tuned.script.masked_args`).

SQLAlchemy is imported (lazily) only for a text that could hold a secret, one with an ``@`` or
a ``?``: a SQLite file's URL is shown without loading it. No Optuna.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, quote_plus, unquote, unquote_plus

from autotune.config import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = ["MASK", "check_storage_url", "holds_secret", "masked", "redact"]

MASK = "***"
"""What a secret is shown as."""

_FORMS = "sqlite:///path/to.db (a file) or postgresql://user:password@host/database"

_SECRET_FIELD = re.compile(r"pass|secret|token|sslkey|credential|auth", re.IGNORECASE)
"""Query fields that hold a secret or name a file of secrets: libpq's ``password``,
``passfile``, ``sslpassword`` and ``sslkey``, and any driver's ``*token*``, ``*secret*``,
``*auth*`` or ``*credential*``."""


def _may_hold_secret(text: str) -> bool:
    """Whether SQLAlchemy could read a secret in ``text``: a user part ends at an ``@``, a
    query begins at a ``?``; without either there is nothing to hide (and nothing to import)."""
    return "@" in text or "?" in text


def _parse(text: str) -> URL | None:
    """``text`` as SQLAlchemy reads a URL, or None where it reads none."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(text)
    except (ArgumentError, ValueError):  # no URL at all; a port that is no number
        return None


def _true_host(parsed: URL) -> tuple[str, str]:
    """The part of SQLAlchemy's host that is the end of a password with an unencoded ``@``
    (a host's name holds no ``@``), and the host itself."""
    host = parsed.host or ""
    cut, at, name = host.rpartition("@")
    return (cut, name) if at else ("", host)


def _query(raw: str) -> dict[str, str | tuple[str, ...]]:
    """A query's fields as SQLAlchemy reads them (``parse_qsl``: ``&`` between fields, blank
    values dropped, a repeated field a tuple of its values)."""
    fields: dict[str, str | tuple[str, ...]] = {}
    for piece in raw.split("&"):
        key, equals, value = piece.partition("=")
        if not equals or not value:
            continue
        key, value = unquote_plus(key), unquote_plus(value)
        before = fields.get(key)
        if before is None:
            fields[key] = value
        else:
            fields[key] = (*((before,) if isinstance(before, str) else before), value)
    return fields


def _secret_spans(url: str, parsed: URL) -> list[tuple[int, int]] | None:
    """Where the secrets ``parsed`` holds lie in ``url``'s text, read by SQLAlchemy's grammar
    (the user runs to the first ``:`` or ``/``, the password to the next ``@``, the query from
    the first ``?`` after the user part to the end of the line). None where the text does not
    read back as ``parsed``: only SQLAlchemy's own rendering of it is then shown."""
    start = url.index("://") + 3
    rest = url[start:]
    spans: list[tuple[int, int]] = []
    user_end = 0
    if parsed.password is not None:
        colon = rest.find(":")
        at = rest.find("@", colon + 1)
        if (
            colon < 0
            or at < 0
            or "/" in rest[:colon]
            or unquote(rest[:colon]) != parsed.username
            or unquote(rest[colon + 1 : at]) != parsed.password
        ):
            return None
        cut, _ = _true_host(parsed)
        end = at + 1 + len(cut) if cut else at
        if cut and rest[at + 1 : end] != cut:
            return None
        spans.append((start + colon + 1, start + end))
        user_end = end + 1
    elif parsed.username is not None:
        stops = [index for index in (rest.find(":"), rest.find("/")) if index >= 0]
        at = rest.rfind("@", 0, min(stops, default=len(rest)))
        if at < 0 or unquote(rest[:at]) != parsed.username:
            return None
        user_end = at + 1
    mark = rest.find("?", user_end)
    if mark < 0:
        return spans if not parsed.query else None
    raw = rest[mark + 1 :].split("\n", 1)[0]
    if _query(raw) != dict(parsed.query):
        return None
    offset = start + mark + 1
    for piece in raw.split("&"):
        key, equals, value = piece.partition("=")
        if equals and value and _SECRET_FIELD.search(unquote_plus(key)):
            spans.append((offset + len(key) + 1, offset + len(piece)))
        offset += len(piece) + 1
    return spans


def _rendered(parsed: URL) -> str:
    """SQLAlchemy's own rendering of ``parsed`` with every secret masked (its password
    hidden, each secret query field's value ``***``)."""
    _, host = _true_host(parsed)
    query = {
        key: MASK if _SECRET_FIELD.search(key) else value for key, value in parsed.query.items()
    }
    text = parsed.set(host=host or None, query=query).render_as_string(hide_password=True)
    return text.replace(f"={quote_plus(MASK)}", f"={MASK}")


def _masked_words(text: str) -> str:
    """``text`` that is no URL, each word of it masked: a URL as :func:`masked` shows it, and
    whatever precedes the last ``@`` of a word shaped like a URL's user part, where it holds a
    ``://`` or a ``:`` (a URL quoted, or one whose scheme is mistyped: ``postgresql:/u:pw@h``);
    other words are kept (``user@host``, a study's name)."""

    def one(found: re.Match[str]) -> str:
        word = found[0]
        if "://" in word and _parse(word) is not None:
            return masked(word)
        head, at, tail = word.rpartition("@")
        return f"{MASK}@{tail}" if at and ":" in head else word

    return re.sub(r"\S+", one, text)


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
"""A URL's scheme and its ``://`` (RFC 3986's grammar of a scheme)."""


def _masked_unread(text: str) -> str:
    """``text`` SQLAlchemy reads as no URL, masked: where it is a URL as a whole (it begins
    with a scheme; a port that is no number), by the URL grammar SQLAlchemy reads with: the
    password is what follows the user's ``:`` up to the last ``@`` before the query, spaces
    and all, and a query field that holds a secret has its value masked; any other text word
    by word (:func:`_masked_words`)."""
    scheme = _SCHEME.match(text)
    if scheme is None:
        return _masked_words(text)
    rest = text[scheme.end() :]
    before, question, query = rest.partition("?")
    userinfo, at, host = before.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if at and colon:
        before = f"{user}:{MASK}@{host}"
    fields = []
    for piece in query.split("&") if question else ():
        key, equals, value = piece.partition("=")
        fields.append(f"{key}={MASK}" if equals and value and _SECRET_FIELD.search(key) else piece)
    return scheme[0] + before + question + "&".join(fields)


def masked(url: str) -> str:
    """``url`` with every secret in it replaced by ``***``: the password of its user part and
    the value of each secret query field (the rest kept as given). A text SQLAlchemy reads as
    no URL (a driver's message, a URL mistyped) has each word that may hold one masked."""
    if not _may_hold_secret(url):
        return url
    parsed = _parse(url)
    if parsed is None:
        return _masked_unread(url)
    spans = _secret_spans(url, parsed)
    if spans is None:
        return _rendered(parsed)
    for begin, end in sorted(spans, reverse=True):
        url = url[:begin] + MASK + url[end:]
    return url


def _secret_values(parsed: URL) -> list[str]:
    """The secrets ``parsed`` holds, as SQLAlchemy reads them: the password (and the part of
    the host an unencoded ``@`` of it cut off), each secret query field's values."""
    found = []
    if parsed.password is not None:
        cut, _ = _true_host(parsed)
        found += [parsed.password, cut, f"{parsed.password}@{cut}" if cut else ""]
    for key, value in parsed.query.items():
        if _SECRET_FIELD.search(key):
            found += [value] if isinstance(value, str) else list(value)
    return [value for value in found if value]


def holds_secret(text: str) -> bool:
    """Whether ``text`` is a URL, as SQLAlchemy reads one, with a secret in it (a password,
    a secret query field; ``***`` too, so a masked URL still is one)."""
    if "://" not in text or not _may_hold_secret(text):
        return False
    parsed = _parse(text)
    return parsed is not None and (parsed.password is not None or bool(_secret_values(parsed)))


def _spellings(url: str) -> list[str]:
    """Every way a text may spell ``url``'s secrets (as written in it, decoded, and encoded
    as SQLAlchemy renders a password or a query value), longest first."""
    if not _may_hold_secret(url):
        return []
    parsed = _parse(url)
    if parsed is None:
        return []
    spans = _secret_spans(url, parsed) or []
    values = [url[begin:end] for begin, end in spans]
    for value in _secret_values(parsed):
        values += [value, quote(value, safe=" +"), quote_plus(value)]
    found = {value for value in values if value and value != MASK}
    return sorted(found, key=len, reverse=True)


def redact(text: str, url: str) -> str:
    """``text`` (a driver's error, say) with ``url`` masked and every secret of ``url`` that
    it quotes in another form replaced by ``***``."""
    text = text.replace(url, masked(url))
    for secret in _spellings(url):
        text = text.replace(secret, MASK)
    return text


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
    if scheme.startswith("sqlite") and _sqlite_uri(rest.partition("?")[2]):
        raise ConfigError(
            f"{masked(url)!r} names its file in SQLite's URI form (uri=true), which autotune "
            "does not read: give the file's path, sqlite:///path/to.db"
        )


_FALSE = frozenset({"false", "no", "off", "n", "f", "0"})
"""The words SQLAlchemy's ``asbool`` reads as false (any other value of an option is true)."""


def _sqlite_uri(query: str) -> bool:
    """Whether a SQLite URL's query turns on SQLite's URI form (``uri=true``: SQLAlchemy's
    SQLite driver then opens the path as a ``file:`` URI, naming another file than the path
    reads as, and with options of its own)."""
    return any(
        key == "uri" and value.strip().lower() not in _FALSE
        for key, value in parse_qsl(query, keep_blank_values=True)
    )

"""A private PostgreSQL server for the study tests (see ``tests/pgserver.py``).

``postgres_url`` starts one server for the session and yields the URL of its ``autotune``
database; ``fresh_postgres_url`` gives a test a database of its own on the same server, so
that studies of the same workload in different tests stay apart.

Without PostgreSQL's server binaries (or the psycopg driver) the tests that need them are
skipped with a line that says how to install them; under CI (``$CI`` set) they fail instead.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
from collections.abc import Iterator

import pytest
from pgserver import INSTALL_HINT, PostgresServer, find_bindir

_numbers = itertools.count()


def _unavailable(reason: str) -> None:
    if "CI" in os.environ:
        pytest.fail(f"{reason} (CI must run the PostgreSQL tests)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One private PostgreSQL server for the session, stopped and removed at its end."""
    bindir = find_bindir()
    if bindir is None:
        _unavailable(f"PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_HINT}")
    if importlib.util.find_spec("psycopg") is None:
        _unavailable("the psycopg driver is missing: pip install 'psycopg[binary]'")
    assert bindir is not None
    server = PostgresServer(bindir).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """``postgresql+psycopg://postgres@127.0.0.1:<port>/autotune`` on the private server."""
    return postgres_server.create_database("autotune")


@pytest.fixture
def fresh_postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A new, empty database on the private server for this test."""
    stem = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40]
    return postgres_server.create_database(f"t{next(_numbers)}_{stem}")

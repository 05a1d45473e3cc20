"""A storage URL's password appears nowhere autotune prints or writes.

The private PostgreSQL server trusts loopback connections, so a URL with a password connects
as one without; the password is then only a marker to look for: in the live view, ``--json``,
a nightly job's output, errors, the probe folders, the HTML report, and every row of the
study's database.
"""

from __future__ import annotations

import json
from pathlib import Path

import sqlalchemy

from tests.test_cli import autotune

SECRET = "s3cr3t-Pa55"
SIM = ("--model", "llama-7b", "--simulate", "h100-80gb", "--gpus", "8", "--budget", "10m")


def _with_password(url: str) -> str:
    """``postgresql+psycopg://postgres:SECRET@127.0.0.1:PORT/db`` from the server's URL."""
    scheme, _, rest = url.partition("://")
    user, _, host = rest.partition("@")
    return f"{scheme}://{user}:{SECRET}@{host}"


def _database_text(url: str) -> str:
    """Every text value of every table of the database, as one string."""
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            tables = sqlalchemy.inspect(connection).get_table_names()
            return "\n".join(
                str(row)
                for table in tables
                for row in connection.execute(sqlalchemy.text(f'SELECT * FROM "{table}"'))
            )
    finally:
        engine.dispose()


def test_the_password_of_a_storage_url_is_never_shown_or_stored(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    url = _with_password(fresh_postgres_url)
    trials = str(tmp_path / "trials")
    outputs = []
    live = autotune("run", *SIM, "--storage", url, "--trials-dir", trials, cwd=tmp_path)
    assert live.returncode == 0, live.stderr
    assert ":***@127.0.0.1" in live.stdout  # the header names the storage, masked
    outputs.append(live)
    (tmp_path / "nightly.yaml").write_text("workloads:\n  - model: qwen2.5-1.5b\n")
    jobs = autotune(
        "run", "--jobs", "nightly.yaml", "--simulate", "h100-80gb", "--storage", url,
        "--trials-dir", trials, "--json", cwd=tmp_path,
    )  # fmt: skip
    assert jobs.returncode == 0, jobs.stderr
    assert json.loads(jobs.stdout)["workloads"][0]["options"]["storage"].count("***") == 1
    outputs.append(jobs)
    for command in (
        ("best", "--json"),
        ("trials", "--json"),
        ("export", "--model", "llama-7b", "--format", "hf", "--json"),
        ("report", "--model", "llama-7b", "-o", str(tmp_path / "report.html")),
    ):
        done = autotune(*command, "--storage", url, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done)
    wrong = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:1/nowhere"  # nothing listens
    refused = autotune("best", "--storage", wrong, cwd=tmp_path)
    assert refused.returncode == 2 and ":***@" in refused.stderr
    outputs.append(refused)

    for done in outputs:
        assert SECRET not in done.stdout + done.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 20 and (tmp_path / "report.html") in written
    leaks = [str(p) for p in written if SECRET.encode() in p.read_bytes()]
    assert not leaks, leaks
    stored = _database_text(fresh_postgres_url)
    assert "llama-7b" in stored and SECRET not in stored

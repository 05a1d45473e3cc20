"""Secrets autotune never shows or stores: a storage URL's password in every form SQLAlchemy
reads, and the secrets among the arguments of a user's own script.

- The URL forms SQLAlchemy's parser accepts with characters a pattern stops at (a password
  holding ``/``, ``?``, ``#``; a query value holding ``,`` or ``#``; an unencoded ``@``): masked
  as SQLAlchemy reads them, and against a real PostgreSQL server that checks passwords (SCRAM),
  which of them connect and that none is shown by a command that connects or fails to.
- A script's arguments: flags that take a secret, found by the words of their name, and URLs
  with a password; a real ``run --script`` on the CPU whose script receives the real values
  while the probe folders, the database, ``best``, ``trials``, the report and the export hold
  none of them, and the exported ``run.sh`` stops unless the user sets them, then hands them
  to the job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

import pytest
from pgserver import INSTALL_HINT, PostgresServer, find_bindir

from autotune.config import ConfigError, TrainConfig
from autotune.handoff.launch import Launch
from autotune.handoff.script import JobCommand, shell_text
from autotune.jobs import JobResult, read_jobs
from autotune.models import resolve_model
from autotune.tuned.script import Framework, ScriptJob, masked_args, referenced_args, secret_flag
from autotune.urls import check_storage_url, holds_secret, masked, redact
from tests.test_cli import autotune

BIN = Path(sys.executable).parent

# ---- storage URLs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown", "pieces"),
    [
        # A password with '/', '?' and '#': SQLAlchemy reads it whole, up to the '@'.
        ("postgresql://u:Yx/9?Kq#Secr@host/db", "postgresql://u:***@host/db", ["Yx/9", "Kq#Secr"]),
        # A query value runs to the next '&': ',' and '#' are part of it.
        ("postgresql://u@host/db?password=q,Tail&sslmode=require",
         "postgresql://u@host/db?password=***&sslmode=require", ["q,Tail", ",Tail"]),
        ("postgresql://u@host/db?password=xx#Tail", "postgresql://u@host/db?password=***",
         ["xx#Tail", "#Tail"]),
        # An unencoded '@': SQLAlchemy cuts the password there and the rest becomes the host.
        ("postgresql://u:Pw1@Tail42x@host/db", "postgresql://u:***@host/db", ["Pw1", "Tail42x"]),
        # A user holding '?': the query is the one after the user part.
        ("postgresql://u?x@host/db?password=q,Tail&a=1",
         "postgresql://u?x@host/db?password=***&a=1", ["q,Tail"]),
        # Encoded secrets, and a harmless field kept as written.
        ("postgresql+psycopg://u:pw%2Cx@host:5/db?sslpassword=s%26t&options=-c%20x",
         "postgresql+psycopg://u:***@host:5/db?sslpassword=***&options=-c%20x",
         ["pw,x", "pw%2Cx", "s&t", "s%26t"]),
        # Any URL SQLAlchemy reads: a git remote with a token.
        ("https://user:ghp_tok42@github.com/org/repo.git",
         "https://user:***@github.com/org/repo.git", ["ghp_tok42"]),
    ],
)  # fmt: skip
def test_every_password_sqlalchemy_reads_is_masked_and_redacted(
    url: str, shown: str, pieces: list[str]
) -> None:
    """Masked where SQLAlchemy's parse puts the secret, the rest as written; a driver's error
    that quotes the URL as written, decoded, as SQLAlchemy renders it, or the host SQLAlchemy
    read (which an unencoded '@' makes of the password's end) loses every piece."""
    from sqlalchemy.engine import make_url

    assert masked(url) == shown
    assert holds_secret(url) and holds_secret(shown)  # a masked URL is still one
    assert masked(shown) == shown
    parsed = make_url(url)
    rendered = parsed.render_as_string(hide_password=False)
    error = redact(
        f"cannot open {url!r} ({unquote(url)}; {rendered}): failed to resolve host "
        f"{parsed.host!r}; password {parsed.password!r}, query {dict(parsed.query)}",
        url,
    )
    leaked = [piece for piece in pieces if piece in error]
    assert not leaked, error


@pytest.mark.parametrize("typed", ["postgresql:/u:Yx9pw@h/db", "postgresql//u:Yx9pw@h/db"])
def test_a_mistyped_storage_url_is_refused_without_its_password(typed: str) -> None:
    """A URL whose scheme is mistyped is no URL to SQLAlchemy, so it has no password by its
    rule; the one line that refuses it still hides what precedes the host."""
    with pytest.raises(ConfigError, match="is not a storage URL") as refused:
        check_storage_url(typed)
    assert "Yx9pw" not in str(refused.value) and "@h/db" in str(refused.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:my secret@host:abc/db", "postgresql://u:***@host:abc/db"),
        ("postgresql://u:s3cr et@h:5x/db?sslpassword=x y&a=1",
         "postgresql://u:***@h:5x/db?sslpassword=***&a=1"),
        ("postgresql://u@h:5x/db?password=my secret", "postgresql://u@h:5x/db?password=***"),
    ],
)  # fmt: skip
def test_a_url_whose_port_is_no_number_shows_no_piece_of_its_password(
    url: str,
    shown: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SQLAlchemy reads such a text as no URL (its port fails to parse), so word by word a
    password with a space showed whole in "cannot open trial storage"; it is masked by the
    URL grammar SQLAlchemy reads with, in ``best`` and ``run``'s one line."""
    from tests.test_bad_input import one_line, run_main

    assert masked(url) == shown
    for command in (("best", "--storage", url), ("run", "--simulate", "h100", "--storage", url)):
        code, stderr = run_main(command, tmp_path, monkeypatch, capsys)
        line = one_line(stderr)
        assert code == 2 and f"cannot open trial storage {shown!r}" in line, line
        assert not [piece for piece in ("secret", "s3cr", "x y") if piece in line], line


def test_a_sqlite_url_is_shown_without_loading_sqlalchemy() -> None:
    """``best`` and ``trials`` read SQLite with Python's sqlite3: showing its URL imports no
    SQLAlchemy (0.1 s of every command); a URL that may hold a secret does."""
    code = (
        "import sys\n"
        "from autotune.urls import masked\n"
        "assert masked('sqlite:///trials/autotune.db') == 'sqlite:///trials/autotune.db'\n"
        "print('sqlalchemy' in sys.modules)\n"
        "masked('postgresql://u:pw@h/db')\n"
        "print('sqlalchemy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]


PASSWORDS = {
    "tuner1": "Yx/9?Kq#Secr",
    "tuner2": "q,Tail9",
    "tuner3": "xx#Tail7",
    "tuner4": "Pw1@Tail42x",
}
"""Each role's password on the server below: each holds what a pattern stopped at."""
PIECES = ("Yx/9", "Kq#Secr", "q,Tail9", ",Tail9", "xx#Tail7", "#Tail7", "Pw1@", "Tail42x")
"""No output may hold any of these."""


@pytest.fixture(scope="module")
def password_server() -> Iterator[PostgresServer]:
    """A private PostgreSQL server whose roles above log in with their password only (SCRAM
    over 127.0.0.1), with a database ``autotune``; the superuser keeps loopback trust."""
    bindir = find_bindir()
    if bindir is None or importlib.util.find_spec("psycopg") is None:
        reason = f"PostgreSQL's server binaries or psycopg are missing: {INSTALL_HINT}"
        if "CI" in os.environ:
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    import psycopg
    from psycopg import sql

    server = PostgresServer(bindir).start()
    try:
        server.create_database("autotune")
        with psycopg.connect(
            host="127.0.0.1", port=server.port, user="postgres", dbname="autotune", autocommit=True
        ) as connection:
            for role, password in PASSWORDS.items():
                connection.execute(
                    sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                        sql.Identifier(role), sql.Literal(password)
                    )
                )
            (server.data_dir / "pg_hba.conf").write_text(
                "local all all trust\n"
                "host all postgres 127.0.0.1/32 trust\n"
                "host all all 127.0.0.1/32 scram-sha-256\n"
            )
            connection.execute("SELECT pg_reload_conf()")
        yield server
    finally:
        server.stop()


def test_each_url_form_that_connects_shows_no_piece_of_its_password(
    password_server: PostgresServer, tmp_path: Path
) -> None:
    """``autotune best`` with each form: the server checks the password, so "no autotune
    study" says it connected, a refusal that it did not; neither shows a piece of it. A
    simulated run through the trickiest form shows it masked in its header and stores none."""
    port = password_server.port
    at = f"127.0.0.1:{port}/autotune"
    forms = {
        f"postgresql+psycopg://tuner1:Yx/9?Kq#Secr@{at}": True,
        f"postgresql+psycopg://tuner2@{at}?password=q,Tail9": True,
        f"postgresql+psycopg://tuner3@{at}?password=xx#Tail7": True,
        f"postgresql+psycopg://tuner4:{quote('Pw1@Tail42x', safe='')}@{at}": True,
        f"postgresql+psycopg://tuner4:Pw1@Tail42x@{at}": False,  # host 'Tail42x@127.0.0.1'
        f"postgresql+psycopg://tuner1:Kq#Secr@{at}": False,  # the wrong password
    }
    outputs = []
    for url, connects in forms.items():
        done = autotune("best", "--storage", url, cwd=tmp_path)
        said = done.stdout + done.stderr
        assert done.returncode == 2, said
        assert ("no autotune study" in said) is connects, (url, said)
        assert ("cannot open trial storage" in said) is not connects, (url, said)
        outputs.append(said)
    url = f"postgresql+psycopg://tuner1:Yx/9?Kq#Secr@{at}"
    run = autotune(
        "run", "--model", "llama-7b", "--simulate", "h100-80gb", "--gpus", "8", "--budget", "1m",
        "--storage", url, "--trials-dir", str(tmp_path / "trials"), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"tuner1:***@{at}" in run.stdout
    outputs.append(run.stdout + run.stderr)
    for said in outputs:
        leaked = [piece for piece in PIECES if piece in said]
        assert not leaked, said
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            tables = sqlalchemy.inspect(connection).get_table_names()
            stored = "\n".join(
                str(row)
                for table in tables
                for row in connection.execute(sqlalchemy.text(f'SELECT * FROM "{table}"'))
            )
    finally:
        engine.dispose()
    assert "llama-7b" in stored
    assert not [piece for piece in PIECES if piece in stored]


# ---- a script's arguments ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "secret"),
    [
        ("--db-password", True), ("--dbpassword", True), ("--passwd", True),
        ("--hub_token", True), ("--hf-token", True), ("--hftoken", True), ("--token", True),
        ("--api-key", True), ("--api_key", True), ("--hf-key", True), ("--apiKey", True),
        ("--client_secret", True), ("--aws-credentials", True), ("--http-auth", True),
        ("--db-pass", True), ("db.password", True), ("+trainer.hub_token", True),
        ("--keep-last", False), ("--keep", False), ("--monkey", False), ("--max-tokens", False),
        ("--max_new_tokens", False), ("--tokenizer", False), ("--author", False),
        ("--input_key", False), ("--pad_token", False), ("--token-id", False),
        ("--auth-type", False), ("--keyboard", False), ("--model", False),
    ],
)  # fmt: skip
def test_a_flag_takes_a_secret_by_the_words_of_its_name(flag: str, secret: bool) -> None:
    assert secret_flag(flag) is secret


ARGS = (
    "--model", "m", "--db-password", "hunter2", "--hub_token=hf_abc", "--api-key", "k-1",
    "--keep-last", "3", "--max-tokens", "5", "--input_key", "prompt", "--use_auth_token", "True",
    "--db-url", "postgresql://u:pgpw@h/db", "--remote=https://x:ghp_1@github.com/o/r.git",
    "sqlite:///t.db?password=p9", "db.password=hydra", "--secret", "-5", "--token", "--verbose",
)  # fmt: skip
MASKED = (
    "--model", "m", "--db-password", "***", "--hub_token=***", "--api-key", "***",
    "--keep-last", "3", "--max-tokens", "5", "--input_key", "prompt", "--use_auth_token", "True",
    "--db-url", "postgresql://u:***@h/db", "--remote=https://x:***@github.com/o/r.git",
    "sqlite:///t.db?password=***", "db.password=***", "--secret", "***", "--token", "--verbose",
)  # fmt: skip


def test_the_secrets_among_a_scripts_arguments_are_masked_as_stored() -> None:
    """``--flag value``, ``--flag=value``, Hydra's ``name=value``, a URL with a password as a
    flag's value or alone; a boolean word, a flag after a flag, and what no secret flag names
    are kept. Masking is idempotent, so a study's key is the masked arguments' hash: another
    password is the same study, another non-secret argument another one."""
    assert masked_args(ARGS) == MASKED
    assert masked_args(MASKED) == MASKED
    job = ScriptJob(framework=Framework.TORCHRUN, path="/x/train.py", args=ARGS, sha256="0" * 64)
    assert job.to_dict()["args"] == list(MASKED)
    other = ScriptJob(
        framework=Framework.TORCHRUN,
        path="/x/train.py",
        args=tuple(arg.replace("hunter2", "hunter3") for arg in ARGS),
        sha256="0" * 64,
    )
    assert other.key == job.key == ScriptJob.from_dict(job.to_dict()).key
    changed = ScriptJob(
        framework=Framework.TORCHRUN,
        path="/x/train.py",
        args=("--model", "n", *ARGS[2:]),
        sha256="0" * 64,
    )
    assert changed.key != job.key


HOSTILE = ("it's", 'a "b" $(touch pwned) `x` \\', "line\nbreak", "p@ss:w/d?#", "True1")


def test_a_shell_script_reads_each_secret_from_a_variable_the_user_must_set(
    tmp_path: Path,
) -> None:
    """The job's shell text with secrets that hold quotes, ``$(...)``, a line break: unset,
    the shell stops at the line, naming the variable, and runs nothing; set, the command gets
    every argument exactly as given (printf as the launcher)."""
    args = ["--plain", "it's fine"]
    for index, value in enumerate(HOSTILE):
        args += [f"--key{index}-password", value, f"--hub{index}-token={value}"]
    args += ["--store", "postgresql://u:" + quote(HOSTILE[1], safe="") + "@h/db"]
    command = JobCommand(
        target=referenced_args(args), env={}, files={}, launcher=("printf", "%s\\0")
    )
    model = resolve_model("tiny")
    launch = Launch(
        model="tiny", hidden_size=model.hidden_size, config=TrainConfig(), micro_batch_size=1,
        grad_accum=1, world_size=1, seq_len=32,
    )  # fmt: skip
    text = shell_text(command, launch, "summary")
    assert not [value for value in HOSTILE if value in text]
    assert "${KEY0_PASSWORD:?set KEY0_PASSWORD: autotune keeps no secrets}" in text
    script = tmp_path / "run.sh"
    script.write_text(text)
    bare = {"PATH": os.environ["PATH"]}
    unset = subprocess.run(["sh", str(script)], cwd=tmp_path, env=bare, capture_output=True)
    assert unset.returncode != 0 and unset.stdout == b""
    assert b"KEY0_PASSWORD: set KEY0_PASSWORD: autotune keeps no secrets" in unset.stderr
    values = {f"KEY{i}_PASSWORD": v for i, v in enumerate(HOSTILE)}
    values |= {f"HUB{i}_TOKEN": v for i, v in enumerate(HOSTILE)}
    values["STORE_URL"] = args[-1]
    done = subprocess.run(
        ["sh", str(script)], cwd=tmp_path, env={**bare, **values}, capture_output=True, check=True
    )
    assert done.stdout.decode().split("\0")[:-1] == args
    assert not list(tmp_path.glob("pwned*"))


def test_a_job_files_script_arguments_are_masked_in_its_label_and_json(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "nightly.yaml").write_text(
        f"workloads:\n  - model: tiny\n    script: {tmp_path / 'train.py'}\n"
        "    framework: torchrun\n"
        "    args: [--db-password, hunter2, --url, 'postgresql://u:pgpw@h/db']\n"
    )
    [job] = read_jobs(tmp_path / "nightly.yaml", {})
    shown = json.dumps(JobResult(job=job, status="failed", why="x").to_dict()) + job.label()
    assert "hunter2" not in shown and "pgpw" not in shown
    assert "--db-password,***,--url,postgresql://u:***@h/db" in job.label()


TRAIN = '''\
"""Records the arguments it was given, then trains as autotune asks."""
import argparse
import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import autotune

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--seen", required=True)
args, _ = parser.parse_known_args()
with open(args.seen, "a") as seen:
    seen.write(json.dumps(sys.argv[1:]) + "\\n")
job = autotune.job_config()
batch, accum = (job.micro_batch_size, job.grad_accum) if job else (1, 1)
steps = (job.max_steps if job else None) or 2
config = AutoConfig.from_pretrained(args.model)
model = AutoModelForCausalLM.from_config(config)
if job and job.ac_every:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(steps):
    for _ in range(accum):
        ids = torch.randint(0, config.vocab_size, (batch, job.seq_len if job else 32))
        (model(input_ids=ids, labels=ids).loss / accum).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''
SECRETS = {"DB_PASSWORD": "hunter2-XYZ", "HUB_TOKEN": "hf_SECRETabc"}
DB_URL = "postgresql://u:pgPASS123@127.0.0.1/db"


def test_a_scripts_secret_arguments_reach_it_and_nothing_autotune_writes(tmp_path: Path) -> None:
    """A real ``run --script`` on the CPU with ``--db-password``, ``--hub_token=`` and a URL
    with a password among the script's arguments (a budget of one probe or two): every run of
    the script gets them as given; no probe folder's file (``config.json``, ``cmd.txt``,
    ``result.json``), no row of the database, nothing ``best``, ``trials``, ``report`` or
    ``export`` print or write holds one.
    The exported ``run.sh`` stops, naming the variable, until the user sets them, and then
    hands the job exactly what it was given."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    (tmp_path / "train.py").write_text(TRAIN)
    seen = tmp_path / "seen" / "argv.jsonl"
    seen.parent.mkdir()
    given = [
        "--model", str(tmp_path / "model"), "--seen", str(seen),
        "--db-password", SECRETS["DB_PASSWORD"], f"--hub_token={SECRETS['HUB_TOKEN']}",
        "--db-url", DB_URL,
    ]  # fmt: skip
    storage = f"sqlite:///{tmp_path}/t.db"
    common = ("--storage", storage, "--model", "model")
    run = autotune(
        "run", "--script", "train.py", "--framework", "torchrun", "--device", "cpu",
        "--device-memory", "1GiB", "--engine", "single", "--seq-len", "32", "--global-batch",
        "2", "--budget", "45s", "--trials-dir", str(tmp_path / "trials"), *common, "--", *given,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    runs = [json.loads(line) for line in seen.read_text().splitlines()]
    assert runs and all(argv == given for argv in runs)  # every probe's run got them as given
    outputs = [run]
    for command in (
        ("best", "--json"),
        ("trials", "--json"),
        ("report", "-o", str(tmp_path / "report.html")),
        ("export", "--format", "command", "-o", str(tmp_path / "run.sh")),
        ("export", "--format", "command", "--json"),
    ):
        done = autotune(*command, *common, cwd=tmp_path)
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done)
    secrets = [*SECRETS.values(), "pgPASS123"]
    for done in outputs:
        assert not [s for s in secrets if s in done.stdout + done.stderr], done.stdout
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != seen.parent]
    names = {p.name for p in written}
    assert {"config.json", "cmd.txt", "result.json", "t.db", "report.html", "run.sh"} <= names
    leaks = [str(p) for p in written if any(s.encode() in p.read_bytes() for s in secrets)]
    assert not leaks, leaks
    best = json.loads(outputs[1].stdout)[0]["fingerprint"]["script"]["args"]
    assert best == [*given[:4], "--db-password", "***", "--hub_token=***", "--db-url",
                    "postgresql://u:***@127.0.0.1/db"]  # fmt: skip

    # The export, run as a user runs it: first without the secrets, then with them.
    path = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    before = seen.read_text()
    unset = subprocess.run(
        ["sh", "run.sh"], cwd=tmp_path, env={**os.environ, **path}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert unset.returncode != 0 and "set DB_PASSWORD: autotune keeps no secrets" in unset.stderr
    assert seen.read_text() == before  # nothing ran
    variables = {**SECRETS, "DB_URL": DB_URL}
    done = subprocess.run(
        ["sh", "run.sh"], cwd=tmp_path, env={**os.environ, **path, **variables},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(seen.read_text().splitlines()[-1]) == given

"""The nightly-job kit in docker/: the compose file, the Kubernetes CronJob and ConfigMap, the
Slurm script and the job file they share, each checked by its own ecosystem's validator
(docker compose, check-jsonschema's compose schema, kubernetes-validate, bash -n, shellcheck,
autotune's job-file reader) and for what a deployment relies on: the storage URL only in
AUTOTUNE_STORAGE, no password written anywhere, the GPUs, shared memory and SIGTERM's lead.

A validator that is not installed skips its test with the way to install it; under CI ($CI set)
it fails instead, as the PostgreSQL tests do.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from autotune import api
from autotune.config import Engine
from autotune.jobs import read_jobs
from autotune.models import preset_names
from autotune.units import parse_duration
from autotune.urls import check_storage_url, masked

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
CRONJOB = DOCKER / "k8s" / "cronjob.yaml"
CONFIGMAP = DOCKER / "k8s" / "configmap.yaml"
SBATCH = DOCKER / "slurm" / "nightly.sbatch"
JOBS = DOCKER / "nightly.yaml"
YAML_FILES = (COMPOSE, CRONJOB, CONFIGMAP, JOBS)

JOBS_MOUNT = "/etc/autotune/nightly.yaml"
"""Where the compose worker and the CronJob see the job file."""
TRIALS_MOUNT = "/workspace/trials"
"""The image's trials folder (docker/Dockerfile's VOLUME)."""
DEFAULT_BUDGET = "30m"
"""``autotune run``'s default budget, for a workload that sets none."""
SETUP_PER_WORKLOAD_S = 10 * 60
"""What a time limit allows each workload above its budget: warm workers, op builds, the
study's set-up."""
GPU_TARGET = ("h100-80gb", 8)
"""The node the example job file is written for (a full node of 8 x H100 80GB)."""
TEST_PASSWORD = "kitcheck0123456789"


# ---------------------------------------------------------------------------------------------
# Helpers


def _missing(reason: str) -> None:
    if "CI" in os.environ:
        pytest.fail(f"{reason} (CI must run the kit's validators)", pytrace=False)
    pytest.skip(reason)


def _program(name: str, install: str) -> str:
    found = shutil.which(name)
    if found is None:
        _missing(f"no {name}: {install}")
    assert found is not None
    return found


def _python_tool(module: str, package: str) -> list[str]:
    """``python -m module`` in this environment, where the dev extra installs it."""
    if importlib.util.find_spec(module) is None:
        _missing(f"no {package}: pip install -e '.[dev]' (or pip install {package})")
    return [sys.executable, "-m", module]


def _compose_command() -> list[str]:
    """``docker compose`` (v2) where the plugin is installed, else ``docker-compose``."""
    docker = shutil.which("docker")
    if docker is not None:
        found = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if found.returncode == 0:
            return [docker, "compose"]
    return [_program("docker-compose", "apt-get install -y --no-install-recommends docker-compose")]


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key set twice in one mapping (which PyYAML, like
    kubectl and docker compose, would silently resolve to the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_UniqueKeyLoader) if doc]


def _compose() -> dict[str, Any]:
    (doc,) = _documents(COMPOSE)
    return doc


def _manifests() -> dict[str, dict[str, Any]]:
    """Every Kubernetes object of docker/k8s by kind."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in _documents(path):
            assert doc["kind"] not in found, f"two {doc['kind']} objects in docker/k8s"
            found[doc["kind"]] = doc
    return found


def _pod(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return manifests["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _jobs() -> list[Any]:
    """docker/nightly.yaml as ``autotune run --jobs`` reads it, with the command line's
    defaults (a workload's own fields override them)."""
    defaults = {
        "budget": DEFAULT_BUDGET,
        "seq_len": None,
        "global_batch": None,
        "gpus": None,
        "engine": None,
        "simulate": None,
        "device": "auto",
        "device_memory": None,
        "headroom": "0%",
        "host_memory": None,
        "objective": "tokens",
        "storage": "sqlite:///trials/autotune.db",
        "trials_dir": "trials",
        "seed": 0,
        "warm": True,
    }
    return read_jobs(JOBS, defaults=defaults)


def _least_time_s() -> float:
    """What a scheduler's time limit must hold: every workload's budget and its set-up."""
    return sum(parse_duration(job.options["budget"]) + SETUP_PER_WORKLOAD_S for job in _jobs())


def _slurm_time_s(text: str) -> float:
    """sbatch's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = [*parts, 0, 0][:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, minutes, seconds = 0, parts[0], (parts[1:] or [0])[0]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _sbatch_options() -> dict[str, str]:
    """The script's ``#SBATCH`` options (those before its first command, as sbatch reads)."""
    options: dict[str, str] = {}
    for line in SBATCH.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            name, _, value = line.removeprefix("#SBATCH ").strip().partition("=")
            assert name not in options, f"#SBATCH {name} set twice"
            options[name] = value
    return options


def _kit_files() -> Iterator[Path]:
    """The files of docker/ that are or would be committed (a local docker/.env is not)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "docker"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode == 0:
        names = [name for name in listed.stdout.decode().split("\0") if name]
        yield from (ROOT / name for name in names if (ROOT / name).is_file())
    else:
        yield from (p for p in DOCKER.rglob("*") if p.is_file() and p.name != ".env")


def _volume(entry: str | dict[str, Any]) -> tuple[str, str, bool]:
    """A compose volume entry, short (``src:dst:ro``) or long syntax, as (source, target,
    read-only)."""
    if isinstance(entry, dict):
        return str(entry.get("source", "")), entry["target"], bool(entry.get("read_only"))
    short = re.fullmatch(r"(?P<source>.*?):(?P<target>/[^:]*)(?::(?P<mode>[a-z,]+))?", entry)
    assert short is not None, entry
    return short["source"], short["target"], "ro" in (short["mode"] or "").split(",")


# ---------------------------------------------------------------------------------------------
# Every file


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses_with_no_key_set_twice(path: Path) -> None:
    assert _documents(path)


URL_WITH_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s/@:'\"`]+:([^\s/@'\"`]*)@")
SECRET_SETTING = re.compile(
    r"(?i)^\s*(?:-\s*)?(?:export\s+)?[\"']?([A-Za-z_][\w.-]*(?:password|passwd|secret|token)"
    r"[\w.-]*)[\"']?\s*[:=]\s*(.*)$"
)
PLACEHOLDERS = {"PASSWORD", "***"}


def _secrets_in(text: str) -> list[str]:
    """Every password written out in ``text``: a URL's password part, or a setting whose name
    says password, secret or token, unless it is an interpolation ($VAR, ${VAR}) or empty."""
    found = []
    for match in URL_WITH_PASSWORD.finditer(text):
        value = match[1]
        if value and not value.startswith("$") and value not in PLACEHOLDERS:
            found.append(match[0])
    for line in text.splitlines():
        setting = SECRET_SETTING.match(line)
        if setting is None or line.lstrip().startswith("#"):
            continue
        value = setting[2].split(" #")[0].strip().strip("\"'")
        if value and not value.startswith(("$", "|", ">")) and value not in PLACEHOLDERS:
            found.append(line.strip())
    return found


def test_the_secret_scan_finds_a_written_password() -> None:
    assert _secrets_in("url: postgresql://tuner:hunter2@db/autotune")
    assert _secrets_in("POSTGRES_PASSWORD=hunter2")
    assert _secrets_in("  - POSTGRES_PASSWORD: hunter2")
    assert not _secrets_in("AUTOTUNE_STORAGE: postgresql://autotune:${POSTGRES_PASSWORD}@db/x")
    assert not _secrets_in("POSTGRES_PASSWORD=\n# the password: letters and digits")
    assert not _secrets_in("postgresql://USER:PASSWORD@HOST:5432/DATABASE")


def test_no_password_is_written_anywhere_in_the_kit() -> None:
    files = list(_kit_files())
    assert {COMPOSE, CRONJOB, CONFIGMAP, SBATCH, JOBS} <= set(files)
    found = {
        str(path.relative_to(ROOT)): hits
        for path in files
        if (hits := _secrets_in(path.read_text(errors="replace")))
    }
    assert found == {}


def test_the_env_file_is_ignored_and_its_example_holds_no_password() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT, capture_output=True, check=False
    )
    if ignored.returncode == 128:
        pytest.skip("not a git work tree")
    assert ignored.returncode == 0, "docker/.env would be committed: docker/.gitignore lists it"
    example = (DOCKER / ".env.example").read_text()
    assert re.search(r"(?m)^POSTGRES_PASSWORD=$", example)


# ---------------------------------------------------------------------------------------------
# The job file


def test_the_job_file_is_read_by_autotune_and_leaves_the_storage_to_the_environment() -> None:
    jobs = _jobs()
    assert 2 <= len(jobs) <= 4
    for job in jobs:
        assert job.model in preset_names()
        # A workload's own storage would override AUTOTUNE_STORAGE: none sets one.
        assert not job.own & {"storage", "trials_dir", "simulate", "device", "device_memory"}
        assert "budget" in job.own


def test_every_workload_has_a_configuration_that_fits_the_node_it_is_written_for() -> None:
    gpu, gpus = GPU_TARGET
    for job in _jobs():
        options = job.options
        engine = options.get("engine")
        plan = api.plan(
            job.model,
            gpu=gpu,
            gpus=gpus,
            seq_len=options.get("seq_len"),
            global_batch=options.get("global_batch"),
            engines=[Engine(name) for name in engine.split(",")] if engine else None,
        )
        assert any(row.time is not None for row in plan.rows), job.label()


# ---------------------------------------------------------------------------------------------
# docker/compose.yaml


def test_docker_compose_accepts_the_compose_file() -> None:
    compose = _compose_command()
    env = {**os.environ, "POSTGRES_PASSWORD": TEST_PASSWORD}
    for name in ("AUTOTUNE_TRIALS_DIR", "POSTGRES_PORT", "DASHBOARD_PORT"):
        env.pop(name, None)
    done = subprocess.run(
        [*compose, "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    tuner = resolved["services"]["tuner"]
    url = tuner["environment"]["AUTOTUNE_STORAGE"]
    assert url == f"postgresql+psycopg://autotune:{TEST_PASSWORD}@postgres:5432/autotune"
    check_storage_url(url)
    assert TEST_PASSWORD not in masked(url)
    volumes = [_volume(entry) for entry in tuner["volumes"]]
    assert (str(JOBS), JOBS_MOUNT, True) in volumes
    assert (str(ROOT / "trials"), TRIALS_MOUNT, False) in volumes


def test_docker_compose_refuses_to_start_without_the_password(tmp_path: Path) -> None:
    compose = _compose_command()
    empty = tmp_path / "empty.env"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "POSTGRES_PASSWORD"}
    done = subprocess.run(
        [*compose, "-f", str(COMPOSE), "--env-file", str(empty), "config"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )
    assert done.returncode != 0
    assert "set POSTGRES_PASSWORD in docker/.env" in done.stdout + done.stderr


def test_the_compose_file_matches_the_compose_specification() -> None:
    tool = _python_tool("check_jsonschema", "check-jsonschema")
    done = subprocess.run(
        [*tool, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_compose_worker_has_the_gpus_shared_memory_job_file_and_storage() -> None:
    services = _compose()["services"]
    assert set(services) == {"postgres", "dashboard", "tuner"}
    tuner = services["tuner"]
    assert tuner["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    devices = tuner["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert tuner["ipc"] == "host"
    assert tuner["depends_on"]["postgres"]["condition"] == "service_healthy"
    volumes = [_volume(entry) for entry in tuner["volumes"]]
    assert ("./nightly.yaml", JOBS_MOUNT, True) in volumes
    assert any(target == TRIALS_MOUNT and not ro for _, target, ro in volumes)
    command = tuner["command"]
    assert command[:3] == ["run", "--jobs", JOBS_MOUNT]
    assert command[command.index("--max-age") + 1] == "7d"
    assert not any(arg.startswith("--storage") for arg in command)
    assert tuner["environment"]["AUTOTUNE_STORAGE"].startswith(
        "postgresql+psycopg://autotune:${POSTGRES_PASSWORD:?"
    )


def test_the_compose_database_and_dashboard() -> None:
    compose = _compose()
    postgres, dashboard = compose["services"]["postgres"], compose["services"]["dashboard"]
    assert postgres["image"].startswith("postgres:")
    assert postgres["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    source, target, _ = _volume(postgres["volumes"][0])
    assert source in compose["volumes"] and target == "/var/lib/postgresql/data"
    assert dashboard["image"].startswith("ghcr.io/optuna/optuna-dashboard:")
    assert dashboard["depends_on"]["postgres"]["condition"] == "service_healthy"
    # The dashboard's URL reaches it through its environment, not its command line.
    assert "://" not in " ".join(dashboard["entrypoint"] + dashboard.get("command", []))
    assert "$$OPTUNA_STORAGE" in dashboard["entrypoint"][-1]
    for service in (postgres, dashboard):
        assert all(str(port).startswith("127.0.0.1:") for port in service["ports"])


def test_the_image_installs_the_postgresql_driver() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"pip install \"?\.\[postgres\]", dockerfile)


# ---------------------------------------------------------------------------------------------
# docker/k8s


@pytest.mark.parametrize("version", ["1.27.0", "latest"])
def test_kubernetes_validate_accepts_the_manifests(version: str) -> None:
    tool = _python_tool("kubernetes_validate", "kubernetes-validate")
    pinned = [] if version == "latest" else ["--kubernetes-version", version]
    done = subprocess.run(
        [*tool, "--strict", *pinned, str(CRONJOB), str(CONFIGMAP)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed for resource") == 3


def test_the_cronjob_runs_one_night_at_a_time_with_the_secret_gpus_and_shared_memory() -> None:
    manifests = _manifests()
    assert set(manifests) == {"CronJob", "ConfigMap", "PersistentVolumeClaim"}
    cronjob = manifests["CronJob"]
    assert cronjob["apiVersion"] == "batch/v1"
    assert len(cronjob["spec"]["schedule"].split()) == 5
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    pod = _pod(manifests)
    (container,) = pod["containers"]

    env = {item["name"]: item for item in container["env"]}
    storage = env["AUTOTUNE_STORAGE"]
    assert "value" not in storage
    assert storage["valueFrom"]["secretKeyRef"] == {"name": "autotune-storage", "key": "url"}
    args = container["args"]
    assert args[:3] == ["run", "--jobs", JOBS_MOUNT]
    assert args[args.index("--max-age") + 1] == "7d"
    assert not any(arg.startswith("--storage") for arg in args)

    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]

    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    trials = volumes[mounts[TRIALS_MOUNT]["name"]]
    pvc = manifests["PersistentVolumeClaim"]
    assert trials["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    jobs_mount = mounts[str(Path(JOBS_MOUNT).parent)]
    assert jobs_mount["readOnly"] is True
    jobs = volumes[jobs_mount["name"]]
    assert jobs["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]


def test_the_cronjob_leaves_room_for_every_budget_and_a_clean_stop() -> None:
    manifests = _manifests()
    job = manifests["CronJob"]["spec"]["jobTemplate"]["spec"]
    assert job["activeDeadlineSeconds"] >= _least_time_s()
    # At the deadline the pod gets SIGTERM; autotune needs a moment to record the probe.
    assert _pod(manifests)["terminationGracePeriodSeconds"] >= 60


def test_the_configmap_holds_the_job_file_unchanged() -> None:
    configmap = _manifests()["ConfigMap"]
    assert configmap["data"] == {Path(JOBS_MOUNT).name: JOBS.read_text()}


# ---------------------------------------------------------------------------------------------
# docker/slurm/nightly.sbatch


def test_bash_parses_the_sbatch_script() -> None:
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "script", [SBATCH, Path(__file__).parents[1] / "bench" / "gpu_call.sh"], ids=lambda p: p.name
)
def test_shellcheck_finds_nothing_in_the_shell_scripts(script: Path) -> None:
    shellcheck = _program("shellcheck", "apt-get install -y --no-install-recommends shellcheck")
    done = subprocess.run(
        [shellcheck, "--shell=bash", "--severity=style", str(script)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_sbatch_script_asks_for_sigterm_before_its_time_limit() -> None:
    options = _sbatch_options()
    assert {"--nodes", "--gpus-per-node", "--time", "--output"} <= set(options)
    signal = re.fullmatch(r"(?:B:)?(?:SIG)?TERM@(\d+)", options["--signal"])
    assert signal is not None, options["--signal"]
    lead = int(signal[1])
    assert lead >= 60
    assert _slurm_time_s(options["--time"]) >= _least_time_s() + lead


def test_the_sbatch_script_runs_autotune_once_in_the_batch_step() -> None:
    commands = [
        line.strip()
        for line in SBATCH.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    runs = [line for line in commands if "autotune run" in line]
    assert runs == ['exec autotune run --jobs "$jobs" --max-age 7d --trials-dir "$trials"']
    assert not any(re.search(r"\bsrun\b", line) for line in commands)
    assert "--storage" not in "\n".join(commands)


def _fake_environment(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """A virtual environment whose ``autotune`` records its arguments and AUTOTUNE_STORAGE,
    a home with its storage file, and the variables sbatch would set."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    record = tmp_path / "record"
    fake = venv / "bin" / "autotune"
    fake.write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > "{record}.argv"\n'
        f'printf "%s" "$AUTOTUNE_STORAGE" > "{record}.storage"\n'
    )
    fake.chmod(0o755)
    home = tmp_path / "home"
    storage = home / ".config" / "autotune" / "storage"
    storage.parent.mkdir(parents=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "1",
        "AUTOTUNE_VENV": str(venv),
    }
    return env, storage, record


def test_the_sbatch_script_passes_the_storage_file_through_the_environment(
    tmp_path: Path,
) -> None:
    env, storage, record = _fake_environment(tmp_path)
    url = f"postgresql://tuner:{TEST_PASSWORD}@db.example:5432/autotune"
    storage.write_text(url + "\n")
    storage.chmod(0o600)
    done = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, check=False, timeout=30
    )
    assert done.returncode == 0, done.stderr
    argv = Path(f"{record}.argv").read_text().splitlines()
    assert argv == [
        "run",
        "--jobs",
        str(JOBS),
        "--max-age",
        "7d",
        "--trials-dir",
        str(ROOT / "trials"),
    ]
    assert Path(f"{record}.storage").read_text() == url


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_the_sbatch_script_refuses_a_storage_file_others_can_read(
    tmp_path: Path, mode: int
) -> None:
    env, storage, record = _fake_environment(tmp_path)
    storage.write_text(f"postgresql://tuner:{TEST_PASSWORD}@db.example/autotune\n")
    storage.chmod(mode)
    done = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, check=False, timeout=30
    )
    assert done.returncode == 2
    assert f"mode {stat.S_IMODE(mode):o}" in done.stderr and "chmod 600" in done.stderr
    assert not Path(f"{record}.argv").exists()


def test_the_sbatch_script_says_where_the_storage_file_goes(tmp_path: Path) -> None:
    env, storage, record = _fake_environment(tmp_path)
    done = subprocess.run(
        ["bash", str(SBATCH)], env=env, capture_output=True, text=True, check=False, timeout=30
    )
    assert done.returncode == 2
    assert f"no storage file {storage}" in done.stderr
    assert not Path(f"{record}.argv").exists()

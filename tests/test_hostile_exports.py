"""Exports, and the files probes write, are code users run: an outside value in them (a model
folder's name, a path, a script's arguments, a host) comes back as itself and runs nothing.

Every format ``autotune export`` writes is written for model folders whose names hold shell,
YAML, Python and Hydra syntax, and read back by what reads it: shell with ``sh -n``, then run
in a folder of its own with fake ``torchrun``, ``accelerate`` and ``python`` on ``PATH`` that
record their arguments; YAML with ``yaml.safe_load``; JSON with ``json``; the FSDP2 module
parsed with ``ast`` and imported; verl's overrides composed by Hydra, OpenRLHF's flags read by
an ``argparse`` parser of its flags. Each is compared with the same export for a folder of a
plain name, that name swapped for the hostile one: nothing else may differ, and no file a
hostile name would create appears.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import autotune as library
from autotune import api
from autotune.cli import app
from autotune.config import Engine, TrainConfig
from autotune.devices import SimulatedDevice
from autotune.handoff.launch import Format, Launch, render
from autotune.handoff.rlhf import RLFormat, RLHFLaunch, render_rlhf
from autotune.handoff.script import JOB_CONFIG_ENV, JobCommand, job_command, shell_text
from autotune.probe.spec import ProbeSpec
from autotune.study import Fingerprint, TrialStore
from autotune.study.rlhf import RLHFStudy, RLHFTrial
from autotune.tuned.script import ScriptJob
from tests.test_cli import autotune as cli_process

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PLAIN = "plainmodel"
"""The plain name every export is compared with (it occurs nowhere else in an export)."""
HOSTILE = {
    "line-breaks": "m\ntouch PWNED_NL\n#\rmain_process_ip: 10.0.0.1\u2028main_process_port: 1",
    "docstring": 'x"""+__import__("os").system("touch PWNED_PY")+"""',
    "shell": "m'; touch PWNED_Q; ' $(touch PWNED_SUB) `touch PWNED_BT` #x",
    "syntax": 'a,b: {m} ${oc.env:HOME} m\\"\\ 模型-ü',
    "keyword": "null",
    "leading-dash": "--help",
}
"""Model folder names, each with the syntax of formats autotune writes (line breaks of every
kind, a YAML key, a docstring's end, shell quotes and substitutions, a comment, Hydra's comma
sweep and OmegaConf's interpolation, backslashes, a YAML keyword, a flag). A command one of them
would run creates a file named ``PWNED...``."""
FAKES = ("torchrun", "accelerate", "python", "python3")
RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["AUTOTUNE_TEST_ARGV"], "a", encoding="utf-8") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""
"""A launcher that records its arguments, one JSON line a call, and starts nothing."""


def swap(value: Any, name: str) -> Any:
    """``value`` with :data:`PLAIN` replaced by ``name`` in every string it holds."""
    if isinstance(value, str):
        return value.replace(PLAIN, name)
    if isinstance(value, dict):
        return {swap(k, name): swap(v, name) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(swap(v, name) for v in value)
    return value


def no_pwned(folder: Path) -> None:
    """No file a hostile name's command would create is in ``folder``, where it ran."""
    found = list(folder.rglob("PWNED*"))
    assert not found, found


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a model folder of the tiny model's config.json under every name, and a
    ``bin`` of fake launchers."""
    folder = tmp_path_factory.mktemp("hostile")
    for name in [PLAIN, *HOSTILE.values()]:
        (folder / "models" / name).mkdir(parents=True)
        shutil.copy(EXAMPLES / "tiny" / "config.json", folder / "models" / name / "config.json")
    fake_launchers(folder)
    return folder


def fake_launchers(folder: Path) -> None:
    """``folder/bin``: the fake launchers."""
    (folder / "bin").mkdir()
    for fake in FAKES:
        (folder / "bin" / fake).write_text(RECORDER)
        (folder / "bin" / fake).chmod(0o755)


def run_shell(text: str, root: Path, where: Path) -> list[list[str]]:
    """Check ``text`` with ``sh -n``, run it in ``where`` with the fake launchers first on
    ``PATH``: the argument lists they were called with."""
    where.mkdir(parents=True)
    script = where / "run.sh"
    script.write_text(text, encoding="utf-8")
    checked = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    log = where.parent / f"{where.name}.argv"
    env = {
        **os.environ,
        "PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "AUTOTUNE_TEST_ARGV": str(log),
    }
    done = subprocess.run(
        ["sh", str(script)], cwd=where, env=env, capture_output=True, text=True, timeout=60
    )
    no_pwned(where)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_bytes().decode().splitlines()]


def cli(*args: str) -> str:
    """``autotune`` with ``args``: its standard output, checked for success."""
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (args, result.stderr, result.exception)
    return result.stdout


class _Swapped(ast.NodeTransformer):
    def __init__(self, name: str) -> None:
        self.name = name

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant(swap(node.value, self.name))


def same_python(text: str, baseline: str, name: str) -> None:
    """``text`` is the Python code of ``baseline`` with the plain name swapped for ``name`` in
    its string literals: the name added no statement and ended no string."""
    expected = _Swapped(name).visit(ast.parse(baseline))
    assert ast.dump(ast.parse(text)) == ast.dump(expected)


# ---- autotune's stand-in: deepspeed, accelerate, hf, torchrun, fsdp ------------------------


@pytest.fixture(scope="module")
def studies(root: Path) -> dict[str, str]:
    """A simulated study of every hostile model folder: its storage URL, by name."""
    storages = {}
    for key, name in HOSTILE.items():
        storage = f"sqlite:///{root}/{key}.db"
        library.tune(
            str(root / "models" / name),
            simulate="h100-80gb",
            gpus=8,
            budget="3m",
            storage=storage,
            trials_dir=str(root / f"trials-{key}"),
        )
        storages[name] = storage
    return storages


STAND_IN = [
    (fmt, engine)
    for fmt in Format
    if fmt is not Format.COMMAND  # a study of a script of the user's own: below
    # torchtitan's presets are Llama 3.1's shapes, not the tiny folder's: a hostile name in its
    # module is tests/test_export_torchtitan.py's
    and fmt is not Format.TORCHTITAN
    for engine in (Engine.DEEPSPEED, Engine.FSDP, Engine.DDP)
    if not (fmt is Format.DEEPSPEED and engine is not Engine.DEEPSPEED)
    and not (fmt is Format.FSDP and engine is not Engine.FSDP)
    and (engine is Engine.DDP) is (fmt is Format.MEGATRON)  # Megatron-LM's own engine
]


def stand_in_export(
    root: Path, storage: str, name: str, fmt: Format, engine: Engine
) -> tuple[str, Launch]:
    """The file ``autotune export --format fmt --engine engine -o FILE`` writes for the study
    of ``name``'s folder, and the launch it exported with the plain name."""
    model = str(root / "models" / name)
    output = root / "out" / f"{fmt.value}-{engine.value}-{list(HOSTILE.values()).index(name)}"
    output.parent.mkdir(exist_ok=True)
    cli("export", "--format", fmt.value, "--engine", engine.value, "--model", model,
        "--storage", storage, "-o", str(output))  # fmt: skip
    launch = library.export(fmt, model=model, storage=storage, engine=engine.value).launch
    return output.read_bytes().decode(), dataclasses.replace(launch, model=PLAIN)


@pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))
def test_every_stand_in_format_writes_a_hostile_folder_name_as_data(
    root: Path, studies: dict[str, str], name: str
) -> None:
    """``autotune export`` of a study of a folder named ``name``, in every format: JSON and
    YAML hold the data of a plain name's export (YAML's comments one line each: no key
    added), the torchrun script runs the same ``torchrun`` and nothing else, the FSDP2
    module is the same code with the name in a string."""
    index = list(HOSTILE.values()).index(name)
    for fmt, engine in STAND_IN:
        text, plain = stand_in_export(root, studies[name], name, fmt, engine)
        baseline = render(plain, fmt)
        where = f"{fmt.value}-{engine.value}"
        if fmt in (Format.DEEPSPEED, Format.HF):
            assert json.loads(text) == swap(json.loads(baseline), name), where
        elif fmt is Format.ACCELERATE:
            assert yaml.safe_load(text) == yaml.safe_load(baseline), where
            assert len(text.split("\n")) == len(baseline.split("\n")), where
        elif fmt is Format.TORCHRUN:
            argv = run_shell(text, root, root / "runs" / f"{where}-{index}")
            plain_argv = run_shell(baseline, root, root / "runs" / f"{where}-{index}-plain")
            assert argv == plain_argv == [["torchrun", "--nnodes=1", "--nproc-per-node=8",
                                           "train.py"]], where  # fmt: skip
        elif fmt is Format.MEGATRON:
            argv = run_shell(text, root, root / "runs" / f"{where}-{index}")
            plain_argv = run_shell(baseline, root, root / "runs" / f"{where}-{index}-plain")
            assert argv == plain_argv and argv[0][:4] == ["torchrun", "--nnodes=1",
                "--nproc-per-node=8", "pretrain_gpt.py"], where  # fmt: skip
        else:
            same_python(text, baseline, name)


def test_the_fsdp_module_of_every_hostile_folder_name_imports_and_runs_nothing(
    root: Path, studies: dict[str, str]
) -> None:
    """The FSDP2 modules of every hostile name, imported in a fresh interpreter: none runs
    code of its name, and each says what it measured with the name as it is."""
    expected: dict[str, str] = {}
    for name in HOSTILE.values():
        found = library.export(
            "fsdp", model=str(root / "models" / name), storage=studies[name], engine="fsdp"
        )
        path = root / "modules" / f"fsdp_{len(expected)}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(found.text, encoding="utf-8")
        expected[str(path)] = found.launch.summary()
    code = (
        "import importlib.util, json, sys\n"
        "measured = {}\n"
        "for path in sys.argv[1:]:\n"
        "    spec = importlib.util.spec_from_file_location('m', path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    measured[path] = module.MEASURED\n"
        "print(json.dumps(measured))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *expected],
        cwd=root / "modules",
        capture_output=True,
        text=True,
        timeout=300,
    )
    no_pwned(root / "modules")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected


# ---- RLHF: trl, openrlhf, verl -------------------------------------------------------------


def rlhf_study(storage: str, name: str, algorithm: str) -> None:
    """An RLHF study of ``name`` (the policy, as the path given to ``run --rlhf``) with the
    layouts a search would record."""
    roles = {"reference": name, "critic": name if algorithm == "ppo" else None, "reward": name}
    study = RLHFStudy(
        {
            "algorithm": algorithm, "policy": name, "policy_model": name, "models": roles,
            "seq_len": 256, "response_len": 192, "rollout_batch": 8,
            "hardware": "1xcpu-cap64MiB", "device": "cpu",
        },
        storage=storage,
    )  # fmt: skip
    for share, outcome, speed in ((0.9, "oom", 0.0), (0.6, "ok", 3.5)):
        study.record(
            RLHFTrial(
                config=TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=1),
                share=share,
                sleep=True,
                micro_batch_size=2,
                outcome=outcome,
                samples_per_second=speed,
            )
        )


def plain_rlhf(launch: RLHFLaunch) -> RLHFLaunch:
    """``launch`` with the plain name for every model."""
    return dataclasses.replace(
        launch,
        policy=PLAIN,
        reference=PLAIN if launch.reference else None,
        critic=PLAIN if launch.critic else None,
        reward=PLAIN if launch.reward else None,
    )


def openrlhf_parser(argv: list[str]) -> argparse.ArgumentParser:
    """An ``argparse`` parser of the flags ``argv`` gives (a flag followed by a value takes
    one; the others are switches), as OpenRLHF's own reads them."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    for index, arg in enumerate(argv):
        if arg.startswith("--"):
            takes = index + 1 < len(argv) and not argv[index + 1].startswith("--")
            parser.add_argument(arg, action="store" if takes else "store_true")
    return parser


def hydra_compose(overrides: list[str], keys: list[str], where: Path) -> dict[str, Any]:
    """Hydra's composition of ``overrides`` on a config of ``keys`` (all None), resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config: dict[str, Any] = {}
    for key in keys:
        *parents, last = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = None
    where.mkdir(parents=True)
    (where / "ppo.yaml").write_text(yaml.safe_dump(config))
    with initialize_config_dir(config_dir=str(where), version_base=None):
        composed = compose("ppo", overrides=overrides)
    return OmegaConf.to_container(composed, resolve=True)  # type: ignore[return-value]


@pytest.fixture
def in_models(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """In the models' folder: an RLHF study names its models by the paths given to it."""
    monkeypatch.chdir(root / "models")
    yield root / "models"


@pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))
def test_every_rlhf_format_writes_a_hostile_model_path_as_data(
    root: Path, in_models: Path, name: str
) -> None:
    """``autotune export --format trl|openrlhf|verl`` of RLHF studies whose models are a
    hostile path: TRL's JSON is the plain one's; OpenRLHF's command runs ``python`` with flags
    that read back as the paths; verl's overrides, composed by Hydra, are the paths (no
    sweep, no interpolation, no other key)."""
    index = list(HOSTILE.values()).index(name)
    ppo, grpo = f"sqlite:///{root}/rl-ppo-{index}.db", f"sqlite:///{root}/rl-grpo-{index}.db"
    rlhf_study(ppo, name, "ppo")
    rlhf_study(grpo, name, "grpo")

    text = cli("export", "--format", "trl", "--storage", grpo)
    plain = plain_rlhf(api.export_rlhf("trl", storage=grpo).launch)
    assert json.loads(text) == swap(json.loads(render_rlhf(plain, RLFormat.TRL)[0]), name)

    for storage in (ppo, grpo):
        kind = "ppo" if storage == ppo else "grpo"
        plain = plain_rlhf(api.export_rlhf("openrlhf", storage=storage).launch)
        text = cli("export", "--format", "openrlhf", "--storage", storage)
        [argv] = run_shell(text, root, root / "runs" / f"openrlhf-{kind}-{index}")
        [plain_argv] = run_shell(
            render_rlhf(plain, RLFormat.OPENRLHF)[0],
            root,
            root / "runs" / f"openrlhf-{kind}-{index}-plain",
        )
        assert argv[:3] == plain_argv[:3] == ["python", "-m", "openrlhf.cli.train_ppo_ray"]
        parser = openrlhf_parser(plain_argv[3:])
        read = vars(parser.parse_args(argv[3:]))
        assert read == swap(vars(parser.parse_args(plain_argv[3:])), name)
        assert read["actor.model_name_or_path"] == read["reward.model_name_or_path"] == name

        plain = plain_rlhf(api.export_rlhf("verl", storage=storage).launch)
        text = cli("export", "--format", "verl", "--storage", storage)
        [argv] = run_shell(text, root, root / "runs" / f"verl-{kind}-{index}")
        [plain_argv] = run_shell(
            render_rlhf(plain, RLFormat.VERL)[0], root, root / "runs" / f"verl-{kind}-{index}-p"
        )
        assert argv[:3] == plain_argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
        keys = [override.split("=", 1)[0] for override in plain_argv[3:]]
        composed = hydra_compose(argv[3:], keys, root / "hydra" / f"{kind}-{index}")
        expected = hydra_compose(plain_argv[3:], keys, root / "hydra" / f"{kind}-{index}-p")
        assert composed == swap(expected, name)
        assert composed["actor_rollout_ref"]["model"]["path"] == name


# ---- a study of the user's own script: --format command ------------------------------------


def script_study(root: Path, name: str, framework: str) -> tuple[str, ScriptJob]:
    """A study of a script in ``name``'s folder, given ``name`` as arguments too, with one
    simulated DeepSpeed measurement (hf, accelerate and torchrun all hand DeepSpeed over)."""
    folder = root / "models" / name
    script = folder / f"train_{framework}.py"
    shutil.copy(EXAMPLES / f"train_{framework}.py", script)
    job = ScriptJob.read(script, framework, ["--note", name, name])
    index = list(HOSTILE.values()).index(name)
    storage = f"sqlite:///{root}/script-{framework}-{index}.db"
    fingerprint = Fingerprint(
        model=name, seq_len=64, global_batch=8, gpu="h100-80gb", gpu_memory_bytes=80 << 30,
        gpus=2, device="cuda", script=job.to_dict(),
    )  # fmt: skip
    store = TrialStore(fingerprint, storage=storage)
    config = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2)
    trials = [store.ask(config, 2)]
    spec = ProbeSpec(
        model=str(folder), config=config, micro_batch_sizes=(2,), seq_len=64, num_processes=2
    )
    probe = root / "probes" / f"script-{framework}-{index}"
    result = SimulatedDevice.named("h100-80gb", seed=0).launch(spec, probe)
    store.record(trials, result)
    return storage, job


def here_documents(where: Path) -> dict[str, Any]:
    """The configuration files a run of the command wrote, parsed."""
    files: dict[str, Any] = {}
    for path in sorted(where.iterdir()):
        if path.suffix == ".json":
            files[path.name] = json.loads(path.read_bytes().decode())
        elif path.suffix == ".yaml":
            files[path.name] = yaml.safe_load(path.read_bytes().decode())
    return files


@pytest.mark.parametrize("name", list(HOSTILE.values()), ids=list(HOSTILE))
def test_the_command_export_runs_the_hostile_script_path_and_arguments_as_given(
    root: Path, name: str
) -> None:
    """``autotune export --format command`` of a script in a hostile folder, given hostile
    arguments, for every framework: the shell script writes the files a plain name's does
    and starts ``torchrun`` or ``accelerate`` with the script's path and arguments exactly."""
    for framework in ("hf", "accelerate", "torchrun"):
        storage, job = script_study(root, name, framework)
        model = str(root / "models" / name)
        text = cli("export", "--format", "command", "--model", model, "--storage", storage)
        launch = library.export("command", model=model, storage=storage).launch
        script = Path(job.path)
        plain_job = dataclasses.replace(
            job, path=str(script.parent.parent / PLAIN / script.name), args=("--note", PLAIN, PLAIN)
        )
        plain = dataclasses.replace(launch, model=PLAIN)
        baseline = shell_text(job_command(plain_job, plain), plain, plain.summary())
        index = list(HOSTILE.values()).index(name)
        where = root / "runs" / f"command-{framework}-{index}"
        argv = run_shell(text, root, where)
        plain_argv = run_shell(baseline, root, where.with_name(f"{where.name}-plain"))
        assert argv == swap(plain_argv, name), framework
        [started] = argv
        at = started.index(job.path)  # the script, then its own arguments, as given
        assert started[at : at + 4] == [job.path, "--note", name, name], started
        assert here_documents(where) == swap(
            here_documents(where.with_name(f"{where.name}-plain")), name
        )


def test_a_here_document_ends_only_where_autotune_ends_it(tmp_path: Path) -> None:
    """A configuration file whose text holds the word that would end its here-document is
    written whole, and the line after that word is not run as a command."""
    text = '{"a": 1}\nAUTOTUNE_EOF\ntouch PWNED_EOF\n'
    command = JobCommand(
        target=("/opt/train.py",), env={JOB_CONFIG_ENV: "job.json"}, files={"job.json": text}
    )
    launch = Launch(
        model="m", hidden_size=64, config=TrainConfig(), micro_batch_size=1, grad_accum=1,
        world_size=1, seq_len=64,
    )  # fmt: skip
    fake_launchers(tmp_path)
    argv = run_shell(shell_text(command, launch, launch.summary()), tmp_path, tmp_path / "run")
    assert (tmp_path / "run" / "job.json").read_text() == text
    assert argv == [["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=1",
                     "/opt/train.py"]]  # fmt: skip


# ---- cmd.txt of a probe of the user's script -----------------------------------------------


def test_cmd_txt_of_a_script_probe_reruns_the_job_and_nothing_else(tmp_path: Path) -> None:
    """A real probe of a torchrun script in a folder with a newline and a command in its name,
    its probes in a folder named the same way: ``cmd.txt`` parses, and run by hand it starts
    ``torchrun`` with the script and its arguments as given (other line breaks in the name
    kept), and runs nothing else."""
    name = "m\ntouch PWNED_M\n#\r\u2028x"
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(EXAMPLES / "tiny" / "config.json", folder / "config.json")
    shutil.copy(EXAMPLES / "train_torchrun.py", folder / "train.py")
    trials = "t\ntouch PWNED_TRIALS\n#"
    done = cli_process(
        "probe", "--script", str(folder / "train.py"), "--framework", "torchrun",
        "--model", str(folder), "--device", "cpu", "--micro-batch", "1", "--seq-len", "32",
        "--trials-dir", trials, "--", "--model", str(folder), "--seq-len", "32",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [cmd] = list((tmp_path / trials).rglob("cmd.txt"))
    fake_launchers(tmp_path)
    argv = run_shell(cmd.read_bytes().decode(), tmp_path, tmp_path / "rerun")
    assert argv == [
        ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=1", str(folder / "train.py"),
         "--model", str(folder), "--seq-len", "32"],
    ]  # fmt: skip

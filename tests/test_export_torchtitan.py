"""``autotune export --format torchtitan``: a module for ``torchtitan.train``, read back by
torchtitan 0.3 itself.

torchtitan runs in an environment of its own (``tests/envs/frameworks.sh torchtitan``: its
pins there, built on first use into ``build/framework-envs``), where
``tests/envs/torchtitan_check.py`` reads each exported module as ``torchtitan.train`` does
(``ConfigManager().parse_args``: the module's ``autotune()``, tyro's options, the
``Trainer.Config`` checks), checks the degrees with ``ParallelDims``, builds the model on the
meta device and counts its parameters, and looks up each pipeline chunk's modules. torchtitan
trains nothing on a CPU (``torchtitan.train`` sets a CUDA device), so no step runs here; the
module's own launcher runs for real, under torchrun, up to torchtitan's parser.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Loss,
    Offload,
    Precision,
    Schedule,
    TrainConfig,
)
from autotune.handoff.launch import Format, render
from autotune.layouts import check_layout, chunk_bounds, data_parallel
from autotune.models import resolve_model
from tests.test_export_megatron import launch

ENVS = Path(__file__).resolve().parent / "envs"


def _unavailable(reason: str) -> None:
    if "CI" in os.environ:
        pytest.fail(f"{reason} (CI must run torchtitan's checks)", pytrace=False)
    pytest.skip(reason)


@functools.cache
def torchtitan_python() -> str:
    """The python of torchtitan's environment, built on first use."""
    done = subprocess.run(
        ["bash", str(ENVS / "frameworks.sh"), "torchtitan", sys.executable],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode != 0:
        _unavailable(f"tests/envs/frameworks.sh torchtitan failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def torchtitan_reads(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What torchtitan reads of each module (``tests/envs/torchtitan_check.py``)."""
    done = subprocess.run(
        [torchtitan_python(), str(ENVS / "torchtitan_check.py")],
        input=json.dumps(items), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def fsdp(**fields: object) -> TrainConfig:
    values: dict[str, object] = {"engine": Engine.FSDP, "zero_stage": 3}
    values.update(fields)
    return TrainConfig(**values)  # type: ignore[arg-type]


LAYOUTS = {
    "8B fsdp2 tp2 pp2x2 interleaved, every block": launch(
        "llama3.1-8b",
        fsdp(tp=2, pp=2, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2, ac_every=1),
        micro_batch_size=2,
    ),
    "70B fsdp2 zero-2 tp8 cp2 on four nodes": launch(
        "llama3-70b", fsdp(zero_stage=2, tp=8, cp=2), world_size=32, nodes=4, seq_len=16384,
        grad_accum=2,
    ),
    "8B ddp pp3 1f1b (11, 11 and 10 blocks) on two nodes": launch(
        "llama3-8b", TrainConfig(engine=Engine.DDP, pp=3), world_size=12, nodes=2, grad_accum=8,
    ),
    "8B fsdp2 parameter offload, compiled blocks, fp32": launch(
        "llama3.1-8b",
        fsdp(offload=Offload.PARAMS, torch_compile=True, precision=Precision.FP32),
        micro_batch_size=4, grad_accum=1,
    ),
    "8B one GPU, pure bf16": launch(
        "llama3.1-8b", TrainConfig(precision=Precision.BF16, ac_every=1), world_size=1,
        grad_accum=16,
    ),
    "405B fsdp2 tp8 pp8 1f1b on 128 GPUs": launch(
        "llama3.1-405b", fsdp(tp=8, pp=8, ac_every=1), world_size=128, nodes=16, seq_len=8192,
        grad_accum=16,
    ),
}  # fmt: skip
"""Layouts torchtitan runs, over the flavors it has presets for; the 70B is Llama 3, whose
shape is the preset's (torchtitan's flavors are Llama 3.1's: another rotary scaling, the same
parameters)."""

ON_CPU = "on_cpu"
"""A config function of the test's own, for the 405B: torchtitan's ``llama3_405b`` preset
builds float8 linears, which torchtitan refuses to build without an SM89+ GPU, so here the
export's ``apply`` is read on torchtitan's 70B preset instead."""


@pytest.fixture(scope="module")
def read_back(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """torchtitan's reading of every layout's export, in one run of its environment."""
    where = tmp_path_factory.mktemp("torchtitan")
    items = []
    for index, exported in enumerate(LAYOUTS.values()):
        module = where / f"autotune_{index}.py"
        module.write_text(render(exported, Format.TORCHTITAN))
        items.append({"path": str(module), "world_size": exported.world_size})
        if exported.spec is not None and exported.spec.num_layers == 126:
            wrapper = where / f"cpu_{index}.py"
            wrapper.write_text(
                f"from autotune_{index} import apply\n"
                "from torchtitan.models.llama3.config_registry import llama3_70b\n\n\n"
                f"def {ON_CPU}():\n    return apply(llama3_70b())\n"
            )
            items[-1] = {"path": str(wrapper), "world_size": exported.world_size,
                         "config": ON_CPU}  # fmt: skip
            items.append({"path": str(module), "world_size": exported.world_size})
    results = torchtitan_reads(items)
    names = list(LAYOUTS)
    return {names[i]: r for i, r in enumerate(results[: len(names)])} | {"405B preset": results[-1]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_torchtitan_reads_every_layout_as_autotune_measured_it(
    name: str, read_back: dict[str, dict[str, Any]]
) -> None:
    exported = LAYOUTS[name]
    config, spec = exported.config, exported.spec
    assert spec is not None
    check_layout(config, spec, world_size=exported.world_size, gpus_per_node=exported.per_node,
                 seq_len=exported.seq_len)  # fmt: skip
    read = read_back[name]
    assert "error" not in read, read
    # The model: torchtitan's own count of the flavor's parameters is autotune's.
    assert read["params"] == spec.num_params
    assert read["shape"] == {
        "hidden": spec.hidden_size, "layers": spec.num_layers,
        "heads": spec.num_attention_heads, "kv_heads": spec.num_key_value_heads,
        "mlp": spec.intermediate_size, "vocab": spec.vocab_size,
    }  # fmt: skip
    assert read["converters"] == 0  # bf16 linears, as measured
    # The layout, as torchtitan's ParallelDims holds it.
    dp = data_parallel(config, exported.world_size)
    sharded = config.engine is Engine.FSDP
    assert read["dims"] == {
        "dp_replicate": 1 if sharded else dp, "dp_shard": dp if sharded else 1,
        "cp": config.cp, "tp": config.tp, "pp": config.pp,
    }  # fmt: skip
    parallelism = read["parallelism"]
    assert parallelism["enable_sequence_parallel"] is (config.tp > 1)
    if sharded:
        reshard = "always" if config.zero_stage == 3 else "never"
        assert parallelism["fsdp_reshard_after_forward"] == reshard
    # The batch: torchtitan's accumulation (the global batch over the local one a
    # data-parallel rank) and a pipeline's microbatches are what autotune measured.
    training = read["training"]
    assert training["seq_len"] == exported.seq_len
    local, total = training["local_batch_size"], training["global_batch_size"]
    assert total == exported.global_batch and total % (local * dp) == 0
    if config.pp > 1:
        micro = parallelism["pipeline_parallel_microbatch_size"]
        assert micro == exported.micro_batch_size and local // micro == exported.grad_accum
        assert total // (local * dp) == 1
    else:
        assert local == exported.micro_batch_size and total // (local * dp) == exported.grad_accum
    # Precision, offload, CUDA graphs (off, as measured), checkpointing, compile, the loss.
    assert training["dtype"] == ("bfloat16" if config.precision is Precision.BF16 else "float32")
    fp32 = config.precision is Precision.FP32
    assert training["mixed_precision_param"] == ("float32" if fp32 else "bfloat16")
    assert training["enable_cpu_offload"] is (config.offload is Offload.PARAMS)
    assert training["disable_cuda_graphs"] is True
    assert read["activation_checkpoint"] == ("FullAC.Config" if config.ac_every else None)
    assert read["compile"] == {"enable": config.torch_compile, "components": ["model"]}
    assert read["loss"] == "CrossEntropyLoss.Config"
    # A pipeline: torchtitan's schedule class takes the chunks a rank holds, each chunk's
    # modules are the model's, and its blocks are the probe's split.
    if config.pp > 1:
        pipeline = read["pipeline"]
        assert pipeline["single_stage"] is (config.pp_virtual == 1)
        assert pipeline["stages_per_rank"] == config.pp_virtual
        assert pipeline["unknown_modules"] == []
        chunks = chunk_bounds(spec.num_layers, config.pp * config.pp_virtual)
        assert pipeline["blocks"] == [len(chunk) for chunk in chunks]


def test_the_405b_preset_needs_a_float8_gpu_to_be_built(
    read_back: dict[str, dict[str, Any]],
) -> None:
    """torchtitan's own llama3_405b preset (the 405B export's ``autotune()`` base) is refused on
    a machine without an SM89+ GPU, by torchtitan's float8 check; the export's ``apply``, read
    above on the 70B preset, replaces its float8 linears."""
    assert "SM89" in read_back["405B preset"].get("error", ""), read_back["405B preset"]


def test_torchtitan_refuses_what_it_should(tmp_path: Path) -> None:
    """The same reading refuses a module whose degrees do not make the world, and an option
    torchtitan does not have: the check can fail."""
    exported = LAYOUTS["8B fsdp2 tp2 pp2x2 interleaved, every block"]
    module = tmp_path / "autotune_refused.py"
    module.write_text(render(exported, Format.TORCHTITAN))
    wrong_world, unknown_option = torchtitan_reads([
        {"path": str(module), "world_size": 4},
        {"path": str(module), "world_size": 8, "argv": ["--training.no-such-option", "1"]},
    ])  # fmt: skip
    assert "WORLD_SIZE(4)" in wrong_world["error"]
    assert "exited 2" in unknown_option["error"]


def test_the_module_starts_torchtitan_train_on_every_rank(tmp_path: Path) -> None:
    """The module run as a script: torchrun (torch's own, in torchtitan's environment) starts
    each of the node's ranks on ``torchtitan.train`` with the module, and torchtitan's parser
    takes the user's options after it. ``--help``: each rank prints the options with the
    module's values as their defaults, then exits (no step runs on a CPU)."""
    exported = launch("llama3.1-8b", TrainConfig(tp=2), world_size=2, grad_accum=2)
    module = tmp_path / "titan_tp2.py"
    module.write_text(render(exported, Format.TORCHTITAN))
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "torchrun").write_text(
        f'#!/bin/sh\nexec "{torchtitan_python()}" -m torch.distributed.run "$@"\n'
    )
    (shim / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "120"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, str(module), "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    degree = [i for i, line in enumerate(lines) if "--parallelism.tensor-parallel-degree" in line]
    assert len(degree) == 2, done.stdout[-3000:]  # one help a rank
    assert all("(default: 2)" in lines[i + 1] for i in degree)
    renamed = tmp_path / "titan-tp2.py"
    renamed.write_text(module.read_text())
    refused = subprocess.run(
        [sys.executable, str(renamed)], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 1 and "is no Python module name" in refused.stderr


REFUSED = {
    "DeepSpeed": (TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3), "without DeepSpeed"),
    "fp16": (TrainConfig(engine=Engine.DDP, precision=Precision.FP16_MIXED), "not fp16"),
    "every 2nd block": (fsdp(ac_every=2), "every 2-th block"),
    "op-level checkpointing": (fsdp(ac_ops=True), "op-level checkpointing"),
    "the chunked loss": (fsdp(loss=Loss.CHUNKED), "no setting for the chunked loss"),
    "flash attention": (fsdp(attention=Attention.FLASH), "the flash_attention_2 attention kernel"),
    "a Qwen model": (fsdp(), "shape of no torchtitan llama3 preset"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_torchtitan_cannot_run_as_measured_is_refused_in_one_line(case: str) -> None:
    config, says = REFUSED[case]
    model = "qwen2.5-7b" if "Qwen" in case else "llama3.1-8b"
    with pytest.raises(ConfigError) as refused:
        render(launch(model, config), "torchtitan")
    message = str(refused.value)
    assert says in message and message.startswith("--format torchtitan: "), message
    assert "\n" not in message


def test_hostile_names_stay_comments_and_strings(tmp_path: Path) -> None:
    """A model's name from outside (a folder's path) reaches the module only through a comment
    line and Python's own string literal: the module compiles and holds it verbatim."""
    name = 'evil"""\nimport os; os.system("touch PWNED")  # \u2028x'
    exported = dataclasses.replace(launch("llama3.1-8b", fsdp()), model=name)
    text = render(exported, Format.TORCHTITAN)
    namespace: dict[str, Any] = {"__name__": "exported"}
    exec(compile(text, "exported.py", "exec"), namespace)
    assert namespace["SUMMARY"].startswith(name)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_a_studys_trial_is_exported_by_the_cli_and_read_by_torchtitan(tmp_path: Path) -> None:
    """``autotune export --format torchtitan --trial N -o FILE`` of a simulated FSDP2 study's
    fastest trial that torchtitan can run (every block checkpointed or none): the file
    torchtitan reads holds the trial's micro-batch, accumulation and checkpointing."""
    from typer.testing import CliRunner

    import autotune
    from autotune.cli import app

    storage = f"sqlite:///{tmp_path}/study.db"
    autotune.tune("llama3.1-8b", simulate="h100-80gb", gpus=8, seq_len=8192, engines=["fsdp"],
                  budget="2m", storage=storage, trials_dir=str(tmp_path / "trials"))  # fmt: skip
    [study] = autotune.trials(storage=storage)
    runnable = [m for m in study.measurements
                if m.feasible and m.value is not None and m.config.ac_every <= 1]  # fmt: skip
    assert runnable, "the study measured no configuration torchtitan runs"
    trial = max(runnable, key=lambda m: m.value or 0.0)
    module = tmp_path / "autotune_best.py"
    done = CliRunner().invoke(app, ["export", "--format", "torchtitan", "--storage", storage,
                                    "--trial", str(trial.number), "-o", str(module)])  # fmt: skip
    assert done.exit_code == 0, done.output
    [read] = torchtitan_reads([{"path": str(module), "world_size": 8}])
    accumulation = trial.grad_accum or 1
    assert read["training"]["local_batch_size"] == trial.micro_batch_size
    assert read["training"]["global_batch_size"] == trial.micro_batch_size * accumulation * 8
    assert read["dims"]["dp_shard"] == 8
    assert read["params"] == resolve_model("llama3.1-8b").num_params
    assert read["activation_checkpoint"] == ("FullAC.Config" if trial.config.ac_every else None)

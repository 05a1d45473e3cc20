"""``autotune export``: every format read back by the library it is for, the DeepSpeed config
and the FSDP2 snippet training a tiny model for real, and the command line's exits."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from shared_study import LLAMA_H100_RUN, finished_run
from test_cli import autotune

import autotune as library
from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
)
from autotune.handoff.launch import (
    Format,
    Launch,
    checkpointing_field,
    deepspeed_config,
    hf_fields,
    knob_notes,
    render,
)
from autotune.models import resolve_model
from autotune.probe.ops import op_environment

TINY = resolve_model("tiny")


def launch(config: TrainConfig, *, world_size: int = 8, nodes: int = 1, **rest: int) -> Launch:
    """A launch of llama-7b's shape unless told otherwise."""
    fields = {"micro_batch_size": 2, "grad_accum": 4, "hidden_size": 4096, **rest}
    return Launch(
        model="llama-7b",
        config=config,
        world_size=world_size,
        nodes=nodes,
        seq_len=2048,
        **fields,
    )


DEEPSPEED_CONFIGS = [
    TrainConfig(engine=Engine.DEEPSPEED, zero_stage=0),
    TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1, precision=Precision.FP16_MIXED),
    TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, offload=Offload.OPTIMIZER, ac_every=1),
    TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.PARAMS, ac_every=2),
]
FSDP_CONFIGS = [
    TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=2),
    TrainConfig(engine=Engine.FSDP, zero_stage=2, offload=Offload.PARAMS, ac_every=1),
    TrainConfig(engine=Engine.FSDP, zero_stage=3, precision=Precision.BF16),
]


def run_python(code: str, tmp_path: Path, timeout: float = 240) -> str:
    """Run ``code`` in a fresh interpreter as rank 0 of a one-process world (its own port),
    with the DeepSpeed ops already built in this environment found, not rebuilt."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = op_environment(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def last_json(tmp_path: Path, argv: list[str]) -> Any:
    """Run ``argv`` in ``tmp_path`` on one thread per process, with the DeepSpeed ops already
    built in this environment found; the JSON its last line of output prints."""
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env={**op_environment(os.environ), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- DeepSpeed --------------------------------------------------------------------------------


def test_deepspeed_configs_are_accepted_by_deepspeeds_config_class(tmp_path: Path) -> None:
    """DeepSpeedConfig validates each export for the 8 ranks it is for (the batch sizes must
    agree with them), and the probes build their engine from the very same function."""
    exports = {
        config.label(): json.loads(render(launch(config), Format.DEEPSPEED))
        for config in DEEPSPEED_CONFIGS
    }
    (tmp_path / "exports.json").write_text(json.dumps(exports))
    out = run_python(
        """
        import json
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig

        import autotune.handoff.launch
        from autotune.probe.engines import deepspeed as engine

        assert engine.deepspeed_config is autotune.handoff.launch.deepspeed_config

        class DataParallel:  # the 8 ranks the export is for, in a one-process world
            def get_data_parallel_world_size(self):
                return 8

        deepspeed.init_distributed(dist_backend="gloo")
        seen = {}
        for label, exported in json.load(open("exports.json")).items():
            config = DeepSpeedConfig(exported, mpu=DataParallel())
            seen[label] = [
                config.train_batch_size,
                config.train_micro_batch_size_per_gpu,
                config.gradient_accumulation_steps,
                int(config.zero_optimization_stage),
                config.bfloat16_config.enabled,
                config.float16_config.enabled,
                str(config.zero_config.offload_optimizer.device)
                if config.zero_config.offload_optimizer else None,
                str(config.zero_config.offload_param.device)
                if config.zero_config.offload_param else None,
            ]
        print(json.dumps(seen))
        """,
        tmp_path,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {
        "deepspeed ac:off": [64, 2, 4, 0, True, False, None, None],
        "deepspeed z1 ac:off fp16-mixed": [64, 2, 4, 1, False, True, None, None],
        "deepspeed z2 off:optimizer ac:every": [64, 2, 4, 2, True, False, "cpu", None],
        "deepspeed z3 off:params ac:every-2": [64, 2, 4, 3, True, False, "cpu", "cpu"],
    }


def test_deepspeed_export_is_what_the_probe_uses_on_gpus() -> None:
    config = DEEPSPEED_CONFIGS[3]
    exported = json.loads(render(launch(config), Format.DEEPSPEED))
    assert exported == deepspeed_config(
        config, micro_batch_size=2, grad_accum=4, world_size=8, hidden_size=4096
    )
    zero = exported["zero_optimization"]
    assert zero["overlap_comm"] is True
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert "torch_adam" not in exported["optimizer"]["params"]


def test_every_format_writes_one_set_of_optimizer_values_and_says_so(tmp_path: Path) -> None:
    """A tuner decides memory and speed, not hyperparameters: where a format must hold AdamW's
    values they are one documented set (the Trainer's defaults), the same in the DeepSpeed
    JSON, the FSDP2 module's optimizer (built here) and the probes'; the Trainer's own
    DeepSpeed config takes them from its arguments ("auto"); and the formats that write them
    say so beside the file. (The JSON once held lr 1e-4, betas 0.9/0.95 and the FSDP2 module
    torch's weight decay 0.01, for the same study.)"""
    import importlib.util

    import torch

    from autotune.config import ADAMW_DEFAULTS
    from autotune.handoff.launch import value_notes
    from autotune.probe.engines.base import build_optimizer

    ds = launch(DEEPSPEED_CONFIGS[0])
    params = json.loads(render(ds, Format.DEEPSPEED))["optimizer"]["params"]
    assert params == {**ADAMW_DEFAULTS, "betas": list(ADAMW_DEFAULTS["betas"])}
    assert hf_fields(ds)["deepspeed"]["optimizer"]["params"] == dict.fromkeys(
        ADAMW_DEFAULTS, "auto"
    )
    [note] = value_notes(ds, Format.DEEPSPEED)
    assert "lr 5e-05, betas 0.9/0.999, eps 1e-08, weight decay 0.0" in note
    assert "scheduler" in note and "gradient_clipping" in note
    # What DeepSpeed itself does without the key: the note says its own default, and the JSON
    # leaves the key to the user.
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert f"clips gradients at norm {GRADIENT_CLIPPING_DEFAULT}" in note
    assert "gradient_clipping" not in json.loads(render(ds, Format.DEEPSPEED))
    path = tmp_path / "fsdp_settings.py"
    fsdp = launch(FSDP_CONFIGS[0])
    path.write_text(render(fsdp, Format.FSDP))
    spec = importlib.util.spec_from_file_location("fsdp_settings", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer = torch.nn.Linear(4, 4)
    exported = module.build_optimizer(layer, lr=ADAMW_DEFAULTS["lr"]).param_groups[0]
    probed = build_optimizer(layer.parameters(), Optimizer.ADAMW, ADAMW_DEFAULTS["lr"])
    for name, value in ADAMW_DEFAULTS.items():
        assert exported[name] == probed.param_groups[0][name] == value, name
    assert value_notes(fsdp, Format.FSDP) and "pass your own" in value_notes(fsdp, Format.FSDP)[0]
    for fmt in (Format.HF, Format.ACCELERATE, Format.TORCHRUN):
        assert value_notes(ds, fmt) == []


def _tiny(config: TrainConfig, *, grad_accum: int) -> Launch:
    """The tiny model on one rank, micro-batch 2, sequence length 16."""
    return Launch(
        model="tiny",
        hidden_size=TINY.hidden_size,
        config=config,
        micro_batch_size=2,
        grad_accum=grad_accum,
        world_size=1,
        seq_len=16,
    )


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, ac_every=1),
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.OPTIMIZER),
    ],
    ids=lambda c: c.label(),
)
def test_a_cpu_deepspeed_engine_trains_from_the_export(config: TrainConfig, tmp_path: Path) -> None:
    """deepspeed.initialize on the tiny model from the exported JSON, one rank on gloo, and
    two optimizer steps. One field is changed: ``torch_adam``, because on the CPU DeepSpeed's
    own Adam ops would have to be built first (the probes set it on the CPU too). The export
    is of a simulated study: its ``autotune`` key, which says so, is passed by."""
    simulated = dataclasses.replace(_tiny(config, grad_accum=2), simulated=True)
    exported = json.loads(render(simulated, Format.DEEPSPEED))
    assert "SIMULATED" in exported["autotune"]
    exported["optimizer"]["params"]["torch_adam"] = True
    (tmp_path / "ds_config.json").write_text(json.dumps(exported))
    out = run_python(
        f"""
        import json, math
        import deepspeed, torch
        from transformers import AutoModelForCausalLM

        from autotune.models import resolve_model
        from autotune.probe.modeling import apply_activation_checkpointing, hf_config

        ds_config = json.load(open("ds_config.json"))
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))
        apply_activation_checkpointing(model, {config.ac_every})
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=list(model.parameters()), config=ds_config
        )
        losses = []
        for _ in range(2 * ds_config["gradient_accumulation_steps"]):
            ids = torch.randint(0, 256, (ds_config["train_micro_batch_size_per_gpu"], 16))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        print(json.dumps([engine.global_steps, engine.zero_optimization_stage(), losses]))
        """,
        tmp_path,
    )
    steps, stage, losses = json.loads(out.strip().splitlines()[-1])
    assert steps == 2
    assert stage == config.zero_stage
    assert all(0 < loss < 20 for loss in losses)


# ---- accelerate -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        *DEEPSPEED_CONFIGS,
        *FSDP_CONFIGS,
        TrainConfig(engine=Engine.DDP, ac_every=2),
        TrainConfig(engine=Engine.SINGLE),
        TrainConfig(engine=Engine.FSDP, zero_stage=3, loss=Loss.CHUNKED),  # a note in comments
    ],
    ids=lambda c: c.label(),
)
def test_accelerate_loads_the_yaml(config: TrainConfig, tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    world = 1 if config.engine is Engine.SINGLE else 16
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        render(launch(config, world_size=world, nodes=2 if world > 1 else 1), "accelerate")
    )
    loaded = load_config_from_file(str(path))
    assert type(loaded).__name__ == "ClusterConfig"
    assert loaded.num_processes == world
    assert loaded.num_machines == (2 if world > 1 else 1)
    expected = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}.get(config.precision.value, "no")
    assert loaded.mixed_precision == expected
    kind = {"single": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}
    assert loaded.distributed_type.value == kind[config.engine.value]
    if config.engine is Engine.DEEPSPEED:
        ds = loaded.deepspeed_config
        assert ds["zero_stage"] == config.zero_stage
        assert ds["gradient_accumulation_steps"] == 4
        assert ds["offload_param_device"] == ("cpu" if config.offload is Offload.PARAMS else "none")
    if config.engine is Engine.FSDP:
        fsdp = loaded.fsdp_config
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_reshard_after_forward"] is (config.zero_stage == 3)
        assert fsdp["fsdp_offload_params"] is (config.offload is Offload.PARAMS)
        assert fsdp["fsdp_activation_checkpointing"] is (config.ac_every == 1)


_ACCELERATE_SCRIPT = """
import json
import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim
from transformers import AutoModelForCausalLM

from autotune.models import resolve_model
from autotune.probe.modeling import hf_config

accelerator = Accelerator()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))
optimizer = DummyOptim(model.parameters())
data = torch.utils.data.DataLoader(torch.randint(0, 256, (8, 16)), batch_size=2)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for ids in data:
    with accelerator.accumulate(model):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
print(json.dumps({
    "engine": type(model).__name__,
    "steps": model.global_steps,
    "stage": model.zero_optimization_stage(),
    "bucket": model.zero_reduce_bucket_size(),
    "lr": model.optimizer.param_groups[0]["lr"],
    "betas": list(model.optimizer.param_groups[0]["betas"]),
}))
"""


def test_accelerate_launches_the_deepspeed_json_as_its_yaml_says(tmp_path: Path) -> None:
    """The accelerate YAML of a DeepSpeed configuration says how to train with the measured
    DeepSpeed JSON; those steps, done as written (keys replaced by deepspeed_config_file,
    mixed_precision deleted, DummyOptim in the script), make ``accelerate launch`` train on
    one CPU rank: DeepSpeed's engine at the configuration's stage, the measured bucket size
    (accelerate's own default is 500M elements), the JSON's optimizer values, 2 steps of
    accumulation 2. The JSON is changed as the CPU probes change it (``torch_adam``) and the
    YAML's use_cpu set, this machine having no GPU."""
    import yaml

    from autotune.config import ADAMW_DEFAULTS
    from autotune.handoff.launch import ACCELERATE_DEEPSPEED_FILE_NOTE

    tiny = _tiny(TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2), grad_accum=2)
    text = render(tiny, Format.ACCELERATE)
    assert ACCELERATE_DEEPSPEED_FILE_NOTE in text
    for step in ("delete mixed_precision", "deepspeed_config_file: ds_config.json", "DummyOptim"):
        assert step in ACCELERATE_DEEPSPEED_FILE_NOTE
    data = yaml.safe_load(text)
    data["deepspeed_config"] = {
        "zero3_init_flag": data["deepspeed_config"]["zero3_init_flag"],
        "deepspeed_config_file": "ds_config.json",
    }
    del data["mixed_precision"]
    data["use_cpu"] = True
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(data))
    ds = json.loads(render(tiny, Format.DEEPSPEED))
    ds["optimizer"]["params"]["torch_adam"] = True
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    (tmp_path / "train.py").write_text(_ACCELERATE_SCRIPT)
    accelerate = Path(sys.executable).with_name("accelerate")
    launch_it = [str(accelerate), "launch", "--config_file", "accelerate.yaml", "train.py"]
    seen = last_json(tmp_path, launch_it)
    assert seen["engine"] == "DeepSpeedEngine" and seen["stage"] == 2
    assert seen["steps"] == 2
    assert seen["bucket"] == TINY.hidden_size**2 == ds["zero_optimization"]["reduce_bucket_size"]
    assert seen["lr"] == ADAMW_DEFAULTS["lr"]
    assert seen["betas"] == list(ADAMW_DEFAULTS["betas"])


# ---- Hugging Face TrainingArguments ------------------------------------------------------------


def test_training_arguments_accept_the_fields(tmp_path: Path) -> None:
    """``TrainingArguments(**fields)`` for DeepSpeed and FSDP exports (in a fresh process:
    TrainingArguments set accelerate's environment variables)."""
    exports = {
        config.label(): hf_fields(launch(config)) for config in (*DEEPSPEED_CONFIGS, *FSDP_CONFIGS)
    }
    for label, fields in exports.items():
        assert json.loads(render(launch(TrainConfig.from_dict(_config(label))), "hf")) == fields
    simulated = dataclasses.replace(launch(DEEPSPEED_CONFIGS[0]), simulated=True)
    exports["simulated"] = json.loads(render(simulated, "hf"))  # its run_name says so
    assert "SIMULATED" in exports["simulated"]["run_name"]
    (tmp_path / "fields.json").write_text(json.dumps(exports))
    out = run_python(
        """
        import json, warnings
        from transformers import TrainingArguments

        seen = {}
        for label, fields in json.load(open("fields.json")).items():
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)  # no deprecated names
                # use_cpu: this machine has no GPU; the exported fields are unchanged.
                args = TrainingArguments(output_dir="out", use_cpu=True, **fields)
            seen[label] = {
                "batch": args.per_device_train_batch_size,
                "accumulation": args.gradient_accumulation_steps,
                "bf16": args.bf16,
                "fp16": args.fp16,
                "checkpointing": args.activation_checkpointing,
                "every": (args.activation_checkpointing_kwargs or {}).get("every_n_layers"),
                "zero": args.hf_deepspeed_config.config["zero_optimization"]["stage"]
                if args.deepspeed else None,
                "fsdp": bool(args.fsdp),
                "reshard": args.fsdp_plugin_args["reshard_after_forward"]
                if args.fsdp else None,
                "fsdp_ac": args.fsdp_plugin_args.get("activation_checkpointing")
                if args.fsdp else None,
                "run_name": args.run_name,
            }
        print(json.dumps(seen))
        """,
        tmp_path,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    run_names = {label: fields.pop("run_name") for label, fields in seen.items()}
    common = {"batch": 2, "accumulation": 4}
    assert seen["deepspeed z3 off:params ac:every-2"] == {
        **common,
        "bf16": True,
        "fp16": False,
        "checkpointing": True,
        "every": 2,
        "zero": 3,
        "fsdp": False,
        "reshard": None,
        "fsdp_ac": None,
    }
    assert seen["deepspeed z1 ac:off fp16-mixed"]["fp16"] is True
    assert seen["deepspeed z1 ac:off fp16-mixed"]["checkpointing"] is False
    # FSDP checkpoints every block with its own wrapper, as the probe does; every other
    # block through the model's checkpointing.
    assert seen["fsdp z2 off:params ac:every"] == {
        **common,
        "bf16": True,
        "fp16": False,
        "checkpointing": False,
        "every": None,
        "zero": None,
        "fsdp": True,
        "reshard": False,
        "fsdp_ac": True,
    }
    assert seen["fsdp z3 ac:every-2"]["checkpointing"] is True
    assert seen["fsdp z3 ac:every-2"]["every"] == 2
    assert seen["fsdp z3 ac:every-2"]["reshard"] is True
    assert "SIMULATED" in run_names["simulated"]  # the Trainer keeps the word
    assert seen["simulated"]["batch"] == seen[DEEPSPEED_CONFIGS[0].label()]["batch"]


def _config(label: str) -> dict[str, object]:
    found = {c.label(): c for c in (*DEEPSPEED_CONFIGS, *FSDP_CONFIGS)}
    return found[label].to_dict()


def test_older_transformers_get_the_older_field_names() -> None:
    config = TrainConfig(engine=Engine.DDP, ac_every=1)
    old = Launch(**{**_launch_fields(launch(config)), "transformers": "4.57.1"})
    fields = hf_fields(old)
    assert fields["gradient_checkpointing"] is True
    assert "activation_checkpointing" not in fields
    assert "activation_checkpointing" in hf_fields(launch(config))


def _launch_fields(value: Launch) -> dict[str, object]:
    return {name: getattr(value, name) for name in Launch.__slots__}  # type: ignore[attr-defined]


# ---- torchrun ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_parses_the_line(nodes: int) -> None:
    from torch.distributed.run import get_args_parser

    text = render(
        launch(TrainConfig(engine=Engine.FSDP, zero_stage=3), world_size=16, nodes=nodes),
        "torchrun",
    )
    [line] = [line for line in text.splitlines() if line.startswith("torchrun ")]
    env = dict(
        line.removeprefix("export ").split("=", 1)
        for line in text.splitlines()
        if line.startswith("export ")
    )
    threads = env.pop("OMP_NUM_THREADS")  # the probes' rule: tests/test_script.py
    assert threads == '"${OMP_NUM_THREADS:-$threads}"'
    assert env == {"NNODES": str(nodes), "NPROC_PER_NODE": str(16 // nodes)}
    args = get_args_parser().parse_args(shlex.split(line)[1:])
    assert args.nnodes == str(nodes)
    assert args.nproc_per_node == str(16 // nodes)
    assert args.training_script == "train.py"
    if nodes > 1:
        assert args.rdzv_backend == "c10d"
        assert args.rdzv_endpoint == "$MASTER_ADDR:29500"  # the shell expands it
    assert "micro-batch per rank: 2" in text
    assert "accumulation steps: 4" in text


# ---- FSDP2 snippet ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        *FSDP_CONFIGS,
        TrainConfig(engine=Engine.FSDP, zero_stage=3, loss=Loss.CHUNKED),
        TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=2, ac_ops=True),
    ],
    ids=lambda c: c.label(),
)
def test_fsdp_snippet_shards_and_trains_a_tiny_model(config: TrainConfig, tmp_path: Path) -> None:
    """The snippet, executed on the tiny model in a one-rank gloo group on the CPU: every
    block and the root sharded (DTensor parameters), the blocks checkpointed as configured,
    the dtypes and offload as the probe sets them, and an optimizer step that trains."""
    snippet = render(_tiny(config, grad_accum=1), Format.FSDP)
    (tmp_path / "fsdp_settings.py").write_text(snippet)
    out = run_python(
        """
        import json
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM

        from autotune.models import resolve_model
        from autotune.probe.modeling import hf_config
        import fsdp_settings

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = fsdp_settings.apply_fsdp(
            AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))
        )
        optimizer = fsdp_settings.build_optimizer(model, lr=1e-3)
        ids = torch.randint(0, 256, (fsdp_settings.MICRO_BATCH_SIZE, 16))
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        blocks = fsdp_settings.decoder_blocks(model)
        print(json.dumps({
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "checkpointed": [isinstance(b, CheckpointWrapper) for b in blocks],
            "dtype": str(next(model.parameters()).dtype),
            "device": next(model.parameters()).device.type,
            "losses": losses,
            "optimizer": type(optimizer).__name__,
        }))
        dist.destroy_process_group()
        """,
        tmp_path,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["sharded"] is True
    layers = len(seen["checkpointed"])
    expected = [
        (bool(config.ac_every) and i % config.ac_every == 0) or config.ac_ops for i in range(layers)
    ]
    assert seen["checkpointed"] == expected
    assert seen["dtype"] == (
        "torch.bfloat16" if config.precision is Precision.BF16 else "torch.float32"
    )
    assert seen["losses"][1] < seen["losses"][0]  # the same batch twice: the step trained
    assert seen["optimizer"] == "AdamW"


def test_the_fsdp_snippet_builds_the_optimizer_measured(tmp_path: Path) -> None:
    """With 8-bit AdamW the snippet's ``build_optimizer`` gives torchao's AdamW8bit of block
    256 (its steps under FSDP2 are tests/probe/test_optimizer.py's probes)."""
    import importlib.util

    import torch

    config = TrainConfig(engine=Engine.FSDP, zero_stage=3, optimizer=Optimizer.ADAMW_8BIT)
    path = tmp_path / "fsdp_8bit.py"
    path.write_text(render(_tiny(config, grad_accum=1), Format.FSDP))
    spec = importlib.util.spec_from_file_location("fsdp_8bit", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    optimizer = module.build_optimizer(torch.nn.Linear(64, 64), lr=1e-3)
    assert type(optimizer).__name__ == "AdamW8bit" and optimizer.block_size == 256


# ---- Knobs a format has no setting for ----------------------------------------------------------

CHUNKED_ADVICE = 'autotune.probe.loss.apply_loss(model, "chunked")'
NOTING = [f for f in Format if f not in (Format.COMMAND, Format.MEGATRON, Format.TORCHTITAN)]
"""The formats that write a knob they have no setting for with a note (Megatron-LM's and
torchtitan's models are not the Hugging Face one: ``megatron`` and ``torchtitan`` refuse the
knobs, tests/test_export_megatron.py and tests/test_export_torchtitan.py)."""


@pytest.mark.parametrize("fmt", NOTING)
def test_every_format_says_how_to_get_the_chunked_loss(fmt: Format) -> None:
    """No trainer format has a setting for the chunked loss: each export says so, with the
    code that computes it (in the text itself where the format takes comments); a
    configuration with the model's own loss has nothing to say."""
    engine = {Format.DEEPSPEED: Engine.DEEPSPEED, Format.FSDP: Engine.FSDP}.get(fmt, Engine.DDP)
    stage = {Engine.DEEPSPEED: 2, Engine.FSDP: 3}.get(engine, 0)
    config = TrainConfig(engine=engine, zero_stage=stage, loss=Loss.CHUNKED)
    [note] = knob_notes(launch(config), fmt)
    assert note.startswith(f"--format {fmt.value} has no setting for the chunked loss")
    assert CHUNKED_ADVICE in note
    text = render(launch(config), fmt)
    if fmt in (Format.ACCELERATE, Format.TORCHRUN, Format.FSDP):
        assert CHUNKED_ADVICE in text
    assert knob_notes(launch(dataclasses.replace(config, loss=Loss.FULL)), fmt) == []


@pytest.mark.parametrize("fmt", [f for f in NOTING if f is not Format.FSDP])
def test_every_format_but_fsdp_says_how_to_get_op_level_checkpointing(fmt: Format) -> None:
    """The FSDP2 snippet applies op-level checkpointing itself; every other format says it has
    no setting for it, and how to apply it; with every N-th block whole too, that the call
    does both."""
    engine = {Format.DEEPSPEED: Engine.DEEPSPEED}.get(fmt, Engine.DDP)
    stage = 2 if engine is Engine.DEEPSPEED else 0
    config = TrainConfig(engine=engine, zero_stage=stage, ac_ops=True)
    [note] = knob_notes(launch(config), fmt)
    assert "no setting for the op-level selective checkpointing" in note
    assert "apply_activation_checkpointing(model, 0, ops=True)" in note
    [both] = knob_notes(launch(dataclasses.replace(config, ac_every=4)), fmt)
    assert "apply_activation_checkpointing(model, 4, ops=True)" in both and "whole too" in both
    fsdp = TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_ops=True)
    assert knob_notes(launch(fsdp), Format.FSDP) == []


@pytest.mark.parametrize("fmt", [Format.ACCELERATE, Format.TORCHRUN])
def test_formats_without_an_optimizer_setting_say_how_to_get_8bit_adamw(fmt: Format) -> None:
    """accelerate's YAML and torchrun's command have no optimizer: each says which to build
    (in its comments too); the Trainer's fields and the FSDP2 snippet carry it themselves."""
    config = TrainConfig(engine=Engine.DDP, optimizer=Optimizer.ADAMW_8BIT)
    [note] = knob_notes(launch(config), fmt)
    assert "torchao.optim.AdamW8bit(model.parameters(), lr=..., block_size=256)" in note
    assert note in render(launch(config), fmt)
    assert knob_notes(launch(config), Format.HF) == []
    fsdp = TrainConfig(engine=Engine.FSDP, zero_stage=3, optimizer=Optimizer.ADAMW_8BIT)
    assert knob_notes(launch(fsdp), Format.FSDP) == []
    assert knob_notes(launch(dataclasses.replace(config, optimizer=Optimizer.ADAMW)), fmt) == []


def test_the_trainer_builds_the_optimizer_the_export_names(tmp_path: Path) -> None:
    """Hugging Face's Trainer, given the exported fields, builds torchao's AdamW8bit for 8-bit
    AdamW and, with no ``optim`` field (the Trainer's default), torch's fused AdamW for the
    other (a fresh process)."""
    fields = {
        o.value: hf_fields(_tiny(TrainConfig(engine=Engine.DDP, optimizer=o), grad_accum=1))
        for o in Optimizer
    }
    assert fields["adamw-8bit"]["optim"] == "adamw_torch_8bit" and "optim" not in fields["adamw"]
    (tmp_path / "fields.json").write_text(json.dumps(fields))
    out = run_python(
        """
        import json
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        from autotune.models import resolve_model
        from autotune.probe.modeling import hf_config

        seen = {}
        for name, fields in json.load(open("fields.json")).items():
            args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], **fields)
            model = AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))
            optimizer = Trainer(model=model, args=args).create_optimizer()
            group = optimizer.param_groups[0]
            block = getattr(optimizer, "block_size", None)
            seen[name] = [type(optimizer).__name__, group.get("fused"), block]
        print(json.dumps(seen))
        """,
        tmp_path,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["adamw"][:2] == ["AdamW", True]
    assert seen["adamw-8bit"] == ["AdamW8bit", None, 256]


def test_the_advice_for_op_level_checkpointing_wraps_every_block() -> None:
    """The call every export gives, on a Hugging Face model: every block checkpointed with the
    selective policy, and a step's gradients as without it."""
    import torch
    from transformers import AutoModelForCausalLM

    from autotune.probe.modeling import apply_activation_checkpointing, decoder_blocks, hf_config

    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    grads = []
    for ops in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(TINY))
        assert apply_activation_checkpointing(model, 0, ops=ops) == (TINY.num_layers if ops else 0)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
        assert all(type(b).__name__ == "CheckpointWrapper" for b in decoder_blocks(model)) is ops
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_the_advice_for_the_chunked_loss_computes_the_models_loss() -> None:
    """The code every export gives for the chunked loss, run on a Hugging Face model: the
    model's own loss within fp32 rounding, also when the Trainer passes ``num_items_in_batch``
    (the step's token count under accumulation)."""
    import torch
    from transformers import AutoModelForCausalLM

    import autotune.probe.loss
    from autotune.probe.modeling import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(TINY))
    input_ids = labels = torch.randint(0, TINY.vocab_size, (3, 700))  # 2,100 tokens: 3 chunks
    expected = model(input_ids=input_ids, labels=labels).loss
    share = model(input_ids=input_ids, labels=labels, num_items_in_batch=5000).loss
    exec(CHUNKED_ADVICE, {"model": model, "autotune": autotune})  # as a user pastes it
    assert model(input_ids=input_ids, labels=labels).loss.item() == pytest.approx(
        expected.item(), rel=1e-5
    )
    got = model(input_ids=input_ids, labels=labels, num_items_in_batch=5000).loss
    assert got.item() == pytest.approx(share.item(), rel=1e-5)


def test_the_trainer_feeds_the_chunked_loss_the_datas_attention_mask(tmp_path: Path) -> None:
    """The Trainer keeps only the dataset's columns the model's forward names: with the
    chunked loss's forward in place, a padded batch still reaches the model with its
    ``attention_mask`` (and the loss masks what the mask says)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import autotune.probe.loss
    from autotune.probe.modeling import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(TINY))
    exec(CHUNKED_ADVICE, {"model": model, "autotune": autotune})
    data = Dataset.from_dict(
        {
            "input_ids": [[5, 6, 7, 0], [8, 9, 10, 11]],
            "attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]],
            "labels": [[5, 6, 7, -100], [8, 9, 10, 11]],
            "text": ["a", "b"],  # a column the model does not take: dropped
        }
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert trainer.compute_loss(model, batch).isfinite()


_TWO_RANKS = """
import json
import os
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import autotune.probe.loss
from autotune.models import resolve_model
from autotune.probe.modeling import hf_config

ADVICE = {advice!r}
dist.init_process_group("gloo")
rank = dist.get_rank()


def fresh():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))


torch.manual_seed(1 + rank)  # each rank its own data: only a real all-reduce agrees
ids = torch.randint(0, 256, (2, 700))
own = fresh()(input_ids=ids, labels=ids).loss.item()
seen = {{}}
for engine in ("ddp", "fsdp"):
    model = fresh()
    exec(ADVICE, {{"model": model, "autotune": autotune}})
    if engine == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.model.layers:
            fully_shard(block)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    flat = torch.cat([
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
        for p in model.parameters()
    ])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    seen[engine] = {{"loss": loss.item(), "flat": flat, "same": torch.equal(*both)}}
if rank == 0:
    print(json.dumps({{
        "own": own,
        "losses": {{k: v["loss"] for k, v in seen.items()}},
        "same": {{k: v["same"] for k, v in seen.items()}},
        "ddp_is_fsdp": torch.allclose(seen["ddp"]["flat"], seen["fsdp"]["flat"], atol=1e-5),
        "moved": (seen["ddp"]["flat"] - torch.cat([
            p.detach().reshape(-1) for p in fresh().parameters()
        ])).abs().max().item(),
    }}))
dist.barrier()  # no rank leaves while another still talks to it
sys.stdout.flush()
# Past the last collective, as the probes' ranks end: the interpreter's teardown of gloo's
# threads aborted a rank now and then ("terminate called without an active exception").
os._exit(0)
"""


def test_the_advice_for_the_chunked_loss_trains_under_ddp_and_fsdp2(tmp_path: Path) -> None:
    """The chunked-loss advice on two gloo ranks, each with its own data, before DDP and
    before FSDP2 wrap the tiny model: the loss is the model's own, one step leaves both
    ranks' weights equal (the gradients were all-reduced; calling the base model from the
    training step skips DDP's hooks, and under FSDP2 mixes sharded and plain tensors), and
    DDP and FSDP2 train the same weights."""
    (tmp_path / "two_ranks.py").write_text(_TWO_RANKS.format(advice=CHUNKED_ADVICE))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    seen = last_json(tmp_path, [*run, "two_ranks.py"])
    for engine in ("ddp", "fsdp"):
        assert seen["losses"][engine] == pytest.approx(seen["own"], rel=1e-5), engine
        assert seen["same"][engine] is True, engine
    assert seen["ddp_is_fsdp"] is True
    assert seen["moved"] > 1e-4  # the step changed the weights


# ---- Formats that cannot express the configuration ----------------------------------------------


def test_formats_refuse_other_engines_and_unknown_names() -> None:
    fsdp = launch(FSDP_CONFIGS[0])
    with pytest.raises(ConfigError, match="use --format accelerate, hf, torchrun or fsdp"):
        render(fsdp, "deepspeed")
    with pytest.raises(ConfigError, match="needs a fsdp configuration"):
        render(launch(DEEPSPEED_CONFIGS[0]), "fsdp")
    with pytest.raises(ConfigError, match="unknown export format 'yaml'"):
        render(fsdp, "yaml")
    with pytest.raises(ConfigError, match="do not split evenly"):
        launch(FSDP_CONFIGS[0], world_size=12, nodes=8)


# ---- The command line and the library, on a real study ------------------------------------------


@pytest.fixture(scope="session")
def study(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A finished study of llama-7b on 8 simulated H100s, made by ``autotune run`` once per
    session (``LLAMA_H100_RUN``): the URL of its SQLite file, which the tests only read."""
    return finished_run(tmp_path_factory, *LLAMA_H100_RUN).storage


def test_the_library_exports_the_best_or_a_named_trial(study: str) -> None:
    [best] = library.best(storage=study)
    assert best.best is not None
    found = library.export("hf", storage=study, model="llama-7b")
    assert found.study == best.study_name
    assert found.launch.config == best.best.config
    assert found.launch.micro_batch_size == best.best.micro_batch_size
    assert found.launch.global_batch == 64
    assert json.loads(found.text)["per_device_train_batch_size"] == best.best.micro_batch_size
    [everything] = library.trials(storage=study)
    deepspeed = next(
        m for m in everything.measurements if m.feasible and m.config.engine is Engine.DEEPSPEED
    )
    chosen = library.export("deepspeed", storage=study, trial=deepspeed.number)
    assert chosen.measurement.number == deepspeed.number
    assert json.loads(chosen.text)["train_micro_batch_size_per_gpu"] == deepspeed.micro_batch_size
    infeasible = next((m for m in everything.measurements if not m.feasible), None)
    if infeasible is not None:
        with pytest.raises(ConfigError, match="did not fit"):
            library.export("hf", storage=study, trial=infeasible.number)
    with pytest.raises(ConfigError, match="has no trial 100000"):
        library.export("hf", storage=study, trial=100000)
    with pytest.raises(ConfigError, match="no autotune study"):
        library.export("hf", storage=study, model="tiny")


def test_the_best_of_an_engine_is_exported_where_the_study_best_is_another(study: str) -> None:
    """``--engine deepspeed``: the fastest DeepSpeed configuration that fit, whatever engine
    the study's best has; a format that cannot express the best names that way out."""
    from autotune.study.measurement import best_point

    [everything] = library.trials(storage=study)
    for engine in (Engine.DEEPSPEED, Engine.FSDP):
        of_engine = [m for m in everything.measurements if m.config.engine is engine]
        expected = best_point(of_engine)
        assert expected is not None, engine
        found = library.export("torchrun", storage=study, engine=engine.value)
        assert (found.launch.config, found.launch.micro_batch_size) == expected.key
    [best] = library.best(storage=study)
    assert best.best is not None
    other = Engine.DEEPSPEED if best.best.config.engine is not Engine.DEEPSPEED else Engine.FSDP
    with pytest.raises(ConfigError, match=f"or --engine {other.value} for the best"):
        library.export(other.value, storage=study)
    with pytest.raises(ConfigError, match="unknown engine 'megatron'"):
        library.export("hf", storage=study, engine="megatron")
    with pytest.raises(ConfigError, match="--trial and --engine"):
        library.export("hf", storage=study, engine="fsdp", trial=0)


def test_a_format_that_cannot_write_the_best_names_the_best_it_can(study: str) -> None:
    """Where the study's best cannot be written in a format (Megatron-LM runs no DeepSpeed,
    the DeepSpeed JSON no FSDP), the refusal names the fastest point it can write, by the
    trial to export: that trial exports, and every faster point is one the format refuses."""
    import re

    from autotune.study.measurement import pooled

    refused = None
    for fmt in ("megatron", "deepspeed", "fsdp"):
        try:
            library.export(fmt, storage=study)
        except ConfigError as error:
            refused = fmt, str(error)
            break
    assert refused is not None, "every format wrote the best: the check checks nothing"
    fmt, message = refused
    named = re.search(rf"; the best {fmt} can write: trial (\d+), .*: --trial (\d+)$", message)
    assert named and named[1] == named[2], message
    chosen = library.export(fmt, storage=study, trial=int(named[1]))
    [everything] = library.trials(storage=study)
    points = sorted(pooled(everything.measurements), key=lambda m: m.value or 0, reverse=True)
    at = next(i for i, m in enumerate(points) if m.key == chosen.measurement.key)
    for faster in points[:at]:
        with pytest.raises(ConfigError):
            library.export(fmt, storage=study, trial=faster.number)


def test_cli_prints_writes_and_refuses_to_overwrite(study: str, tmp_path: Path) -> None:
    printed = autotune("export", "--storage", study, "--format", "accelerate", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "distributed_type:" in printed.stdout
    target = tmp_path / "ds.yaml"
    wrote = autotune(
        "export", "--storage", study, "--format", "accelerate", "-o", str(target), cwd=tmp_path
    )
    assert wrote.returncode == 0, wrote.stderr
    assert target.read_text() == printed.stdout
    target.write_text("mine\n")
    again = autotune(
        "export", "--storage", study, "--format", "hf", "-o", str(target), cwd=tmp_path
    )
    assert again.returncode == 2
    assert "exists: add --force" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert target.read_text() == "mine\n"
    forced = autotune(
        "export",
        "--storage",
        study,
        "--format",
        "hf",
        "-o",
        str(target),
        "--force",
        "--json",
        cwd=tmp_path,
    )
    assert forced.returncode == 0, forced.stderr
    data = json.loads(forced.stdout)
    assert target.read_text() == data["text"]
    assert data["output"] == str(target)
    assert data["format"] == "hf"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--format", "yaml"), "unknown export format 'yaml'"),
        (("--format", "hf", "--trial", "100000"), "has no trial 100000"),
        (("--format", "hf", "--study", "nope"), "no study named 'nope'"),
        (("--format", "hf", "--model", "tiny"), "no autotune study"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    study: str, tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    done = autotune("export", "--storage", study, *args, cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_cli_trial_exports_that_trial(study: str, tmp_path: Path) -> None:
    [everything] = library.trials(storage=study)
    fsdp = next(m for m in everything.measurements if m.feasible and m.config.engine is Engine.FSDP)
    done = autotune(
        "export",
        "--storage",
        study,
        "--format",
        "torchrun",
        "--trial",
        str(fsdp.number),
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["trial"] == fsdp.number
    assert data["config"] == fsdp.config.to_dict()
    assert "torchrun --nnodes=1 --nproc-per-node=8 train.py" in data["text"]


def test_a_chunked_best_is_exported_with_its_note(tmp_path: Path) -> None:
    """``run --loss chunked`` on a simulated A100 40GB: the study's best has the chunked loss;
    its export says so on stderr beside the file, and in --json. Every configuration the run
    searches has the chunked loss, so three minutes of the simulated clock (a few probes)
    make such a best."""
    storage = f"sqlite:///{tmp_path}/t.db"
    common = ("--storage", storage)
    done = autotune(
        "run",
        *("--simulate", "a100-40gb", "--gpus", "1", "--model", "qwen2.5-1.5b"),
        *("--loss", "chunked", "--budget", "3m", "--trials-dir", str(tmp_path / "trials")),
        *common,
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    [best] = library.best(storage=storage)
    assert best.best is not None and best.best.config.loss is Loss.CHUNKED
    shown = autotune("export", "--format", "hf", *common, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "note: --format hf has no setting for the chunked loss" in shown.stderr
    assert json.loads(shown.stdout)["per_device_train_batch_size"] >= 1
    data = json.loads(autotune("export", "--format", "hf", *common, "--json", cwd=tmp_path).stdout)
    assert data["config"]["loss"] == "chunked"
    assert len(data["notes"]) == 1 and CHUNKED_ADVICE in data["notes"][0]


def test_the_fused_loss_is_the_trainers_liger_setting_and_a_note_elsewhere(tmp_path: Path) -> None:
    """--format hf turns on Liger-Kernel with only its fused linear cross-entropy (what was
    measured), and TrainingArguments takes the fields; the other formats say they have no
    setting for it and give the call the Trainer makes."""
    config = TrainConfig(engine=Engine.DDP, loss=Loss.FUSED)
    fields = hf_fields(launch(config))
    assert fields["use_liger_kernel"] is True
    assert fields["liger_kernel_config"] == {
        "fused_linear_cross_entropy": True,
        "cross_entropy": False,
        "rope": False,
        "rms_norm": False,
        "swiglu": False,
    }
    # In a fresh process (TrainingArguments sets accelerate's environment variables);
    # use_cpu and no bf16: this machine has no GPU, the exported Liger fields are unchanged.
    (tmp_path / "fields.json").write_text(json.dumps({**fields, "bf16": False}))
    out = run_python(
        """
        import json
        from transformers import TrainingArguments

        fields = json.load(open("fields.json"))
        args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], **fields)
        print(json.dumps([args.use_liger_kernel, args.liger_kernel_config]))
        """,
        tmp_path,
    )
    used, liger = json.loads(out.strip().splitlines()[-1])
    assert used is True and liger == fields["liger_kernel_config"]
    assert knob_notes(launch(config), Format.HF) == []
    for fmt in (Format.ACCELERATE, Format.TORCHRUN):
        [note] = knob_notes(launch(config), fmt)
        assert (
            "_apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True" in note
        )
        assert "rms_norm=False" in note
    assert "Liger-Kernel's fused linear cross-entropy" in render(launch(config), Format.TORCHRUN)


@pytest.mark.parametrize("attention", [Attention.EAGER, Attention.FLASH])
def test_every_format_says_which_attention_kernel_to_load(attention: Attention) -> None:
    """The attention kernel is the model's loading, which no trainer format sets: every
    format says how (in its comments too); sdpa, the default, needs no word."""
    for fmt in NOTING:
        engine = {Format.DEEPSPEED: Engine.DEEPSPEED, Format.FSDP: Engine.FSDP}.get(fmt)
        config = TrainConfig(
            engine=engine or Engine.DDP,
            zero_stage={Engine.DEEPSPEED: 2, Engine.FSDP: 3}.get(engine or Engine.DDP, 0),
            attention=attention,
        )
        [note] = knob_notes(launch(config), fmt)
        assert f'attn_implementation="{attention.value}"' in note
        if fmt in (Format.ACCELERATE, Format.TORCHRUN, Format.FSDP):
            assert note in render(launch(config), fmt)
        sdpa = dataclasses.replace(config, attention=Attention.SDPA)
        assert knob_notes(launch(sdpa), fmt) == []


def test_a_lora_configuration_says_how_in_every_format_and_peft_builds_what_was_counted(
    tmp_path: Path,
) -> None:
    """No trainer format carries LoRA's adapters: hf, accelerate and torchrun each say how,
    with the peft call; that call, run by peft on the tiny model, makes as many trainable
    parameters as the estimator counts, and Hugging Face's Trainer takes the hf fields and
    trains the adapters alone for a step."""
    config = TrainConfig(engine=Engine.SINGLE, precision=Precision.FP32, lora_rank=8)
    tiny = launch(config, world_size=1)
    for fmt in (Format.HF, Format.ACCELERATE, Format.TORCHRUN):
        [note] = knob_notes(tiny, fmt)
        assert note.startswith(f"--format {fmt.value} has no setting for LoRA")
        assert "frozen in fp32" in note and "this trains adapters, not the model" in note
    assert "training: LoRA, rank 8" in render(tiny, Format.TORCHRUN)
    call = note.split("then ", 1)[1].split(" before", 1)[0]
    assert call.startswith("model = peft.get_peft_model(")
    spec = resolve_model("tiny")
    (tmp_path / "fields.json").write_text(json.dumps({**hf_fields(tiny), "bf16": False}))
    out = run_python(
        f"""
        import json
        import peft
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
        from autotune.models import resolve_model
        from autotune.probe.modeling import hf_config

        model = AutoModelForCausalLM.from_config(hf_config(resolve_model("tiny")))
        {call}
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        before = {{n: p.detach().clone() for n, p in model.named_parameters()}}
        ids = torch.randint(0, 256, (16, 32))
        data = [{{"input_ids": row, "labels": row}} for row in ids]
        fields = json.load(open("fields.json"))
        fields["max_steps"] = 1
        args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], **fields)
        Trainer(model=model, args=args, train_dataset=data).train()
        changed = sorted(
            n for n, p in model.named_parameters() if not torch.equal(p, before[n])
        )
        print(json.dumps([trainable, changed]))
        """,
        tmp_path,
    )
    trainable, changed = json.loads(out.strip().splitlines()[-1])
    assert trainable == spec.lora_params(8)
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)


def test_activation_offload_says_how_in_every_format_and_the_trainer_runs_it(
    tmp_path: Path,
) -> None:
    """No trainer format but hf (with every block checkpointed: the next test) has autotune's
    activation offload: every format says how (the FSDP2 snippet and the torchrun script in
    their comments), and Hugging Face's Trainer, given its checkpointing of every block and
    the note's call, trains a step with each block's input, and nothing else, held on the
    host."""
    config = TrainConfig(engine=Engine.SINGLE, precision=Precision.FP32, ac_every=1)
    moved = dataclasses.replace(config, act_offload=True)
    single = launch(moved, world_size=1)
    assert knob_notes(single, Format.HF) == []
    assert knob_notes(launch(dataclasses.replace(moved, ac_every=2), world_size=1), Format.HF)
    for fmt in (Format.ACCELERATE, Format.TORCHRUN):
        [note] = knob_notes(single, fmt)
        assert note.startswith(f"--format {fmt.value} has no setting for the activation offload")
        assert knob_notes(launch(config, world_size=1), fmt) == []
    assert "activation offload: saved tensors in pinned host memory" in render(
        single, Format.TORCHRUN
    )
    sharded = launch(TrainConfig(engine=Engine.FSDP, zero_stage=3, act_offload=True))
    assert "activation offload" in render(sharded, Format.FSDP)
    call = note.split("model, call ", 1)[1].split(": each block", 1)[0]
    assert call.startswith("autotune.probe.offload.apply_activation_offload(")
    fields = {**hf_fields(dataclasses.replace(single, config=config)), "bf16": False}
    (tmp_path / "fields.json").write_text(json.dumps(fields))
    out = run_python(
        f"""
        import json
        import torch
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
        import autotune.probe.modeling
        import autotune.probe.offload
        from autotune.models import resolve_model

        model = AutoModelForCausalLM.from_config(
            autotune.probe.modeling.hf_config(resolve_model("tiny"))
        )
        {call}
        ids = torch.randint(0, 256, (16, 32))
        data = [{{"input_ids": row, "labels": row}} for row in ids]
        fields = json.load(open("fields.json"))
        fields["max_steps"] = 1
        args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], **fields)
        Trainer(model=model, args=args, train_dataset=data).train()
        print(json.dumps([fields["activation_checkpointing"],
                          fields["per_device_train_batch_size"],
                          autotune.probe.offload.HOST_POOL.peak_bytes]))
        """,
        tmp_path,
    )
    checkpointed, mbs, held = json.loads(out.strip().splitlines()[-1])
    spec = resolve_model("tiny")
    assert checkpointed is True
    # Each block's fp32 input, for the micro-batch's tokens: what the estimator moves too.
    assert held == spec.num_layers * mbs * 32 * spec.hidden_size * 4


def test_the_hf_fields_carry_activation_offload_where_every_block_is_checkpointed(
    tmp_path: Path,
) -> None:
    """With every block checkpointed through the model, the hf fields carry the offload
    (transformers' ``activation_checkpointing_kwargs={"offload": True}``), where an older
    transformers, FSDP's own checkpointing or every other block get the note instead. The
    Trainer takes the fields and offloads each block's saved input through torch's
    ``save_on_cpu`` with pinned memory: on this machine, which has no pinned-memory allocator,
    its first step stops exactly there (on a GPU it trains)."""
    moved = TrainConfig(engine=Engine.DDP, precision=Precision.FP32, ac_every=1, act_offload=True)
    fields = hf_fields(launch(moved))
    assert fields["activation_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}
    for other in (
        dataclasses.replace(launch(moved), transformers="5.22.0"),
        launch(dataclasses.replace(moved, ac_every=2)),
        launch(dataclasses.replace(moved, engine=Engine.FSDP, zero_stage=3)),
    ):
        kwargs = hf_fields(other).get(checkpointing_field(other.transformers) + "_kwargs", {})
        assert "offload" not in kwargs
        assert any("activation offload" in note for note in knob_notes(other, Format.HF))
    (tmp_path / "fields.json").write_text(json.dumps({**fields, "bf16": False}))
    out = run_python(
        """
        import json, traceback
        import torch
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
        import autotune.probe.modeling
        from autotune.models import resolve_model

        model = AutoModelForCausalLM.from_config(
            autotune.probe.modeling.hf_config(resolve_model("tiny"))
        )
        ids = torch.randint(0, 256, (8, 32))
        fields = json.load(open("fields.json"))
        args = TrainingArguments(
            output_dir="out", use_cpu=True, report_to=[], max_steps=1, **fields
        )
        try:
            Trainer(
                model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]
            ).train()
            print(json.dumps(["trained", ""]))
        except RuntimeError as error:
            frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
            print(json.dumps([str(error), frames[-1]]))
        """,
        tmp_path,
    )
    error, where = json.loads(out.strip().splitlines()[-1])
    assert "pin_memory" in error and where == "pack_to_cpu", (error, where)


def test_compiled_blocks_say_how_in_every_format() -> None:
    """The formats' compile options compile the whole model: each says how to compile each
    block as autotune measured, and the torchrun script lists it."""
    config = TrainConfig(engine=Engine.DDP, torch_compile=True)
    for fmt in (Format.HF, Format.ACCELERATE, Format.TORCHRUN):
        [note] = knob_notes(launch(config), fmt)
        assert note.startswith(f"--format {fmt.value} has no setting for compiling each")
        assert "block.compile()" in note
    assert "compiled: each decoder block" in render(launch(config), Format.TORCHRUN)
    assert knob_notes(launch(TrainConfig(engine=Engine.DDP)), Format.HF) == []


def test_the_torchrun_export_names_the_optimizer_each_engine_builds() -> None:
    """DeepSpeed builds its own AdamW from its JSON (FusedAdam on the GPU, DeepSpeedCPUAdam
    with offload): the torchrun line's notes name it, not torch's fused AdamW."""
    deepspeed = render(launch(TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2)), "torchrun")
    assert "optimizer: DeepSpeed's fused AdamW" in deepspeed
    assert "torch's fused AdamW" not in deepspeed
    offload = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, offload=Offload.OPTIMIZER)
    assert "optimizer: DeepSpeed's CPU AdamW" in render(launch(offload), "torchrun")
    fsdp = render(launch(TrainConfig(engine=Engine.FSDP, zero_stage=3)), "torchrun")
    assert "optimizer: torch's fused AdamW" in fsdp

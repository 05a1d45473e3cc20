"""``autotune export --format megatron``: Megatron-LM's arguments, read back by megatron-core.

Megatron-LM builds most of its options from megatron-core's ``TransformerConfig`` (an option
``--a-b`` is the field ``a_b``) and hands them to it in ``core_transformer_config_from_args``;
megatron-core's ``__post_init__`` then checks them (heads over TP, sequence parallelism only
with TP, a pipeline's dtype, the recompute options). Megatron-LM itself is not on PyPI (its
``megatron.training`` package ships only in its repository), so its few mappings that are not
a field's name are :func:`megatron_config`'s, each named there; what megatron-core checks is
megatron-core's own code. The exported script is run for real (``sh``, ``torchrun``) with a
stand-in for Megatron-LM's ``pretrain_gpt.py`` that records what each rank was given.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.config import ConfigError, Engine, Loss, Offload, Precision, Schedule, TrainConfig
from autotune.handoff.launch import Format, Launch, render
from autotune.handoff.megatron import megatron_arguments, megatron_environment
from autotune.layouts import check_layout, data_parallel, pipeline_microbatches_ok
from autotune.models import resolve_model

TRAINING = {"micro_batch_size", "global_batch_size", "seq_length", "max_position_embeddings",
            "position_embedding_type", "use_torch_fsdp2"}  # fmt: skip
"""Megatron-LM's options of the export that are no field of megatron-core's config (training,
data and model-construction options)."""


@functools.cache
def transformer_config() -> type:
    """megatron-core's ``TransformerConfig``, imported once by the test worker that needs it
    (the import takes seconds; without Transformer Engine or Apex it warns of its fallbacks)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig


def megatron_config(argv: list[str]) -> tuple[Any, dict[str, object]]:
    """megatron-core's ``TransformerConfig`` from Megatron-LM's arguments, and the training
    options beside it. Megatron-LM's mappings that are not a field's own name (from
    ``megatron/training/arguments.py``): ``--swiglu`` is a gated linear unit with SiLU;
    ``--disable-bias-linear`` is ``add_bias_linear=False``; ``--num-query-groups`` counts only
    with ``--group-query-attention``; ``--untie-embeddings-and-output-weights`` is the
    model's; ``--num-layers-per-virtual-pipeline-stage`` gives the virtual stages (the layers
    of a stage over it); ``--bf16`` sets the parameters' and the pipeline's dtype."""
    config_class = transformer_config()
    fields_of = {f.name: f for f in dataclasses.fields(config_class)}
    options: dict[str, object] = {}
    key = None
    for word in argv:
        if word.startswith("--"):
            key = word[2:].replace("-", "_")
            options[key] = True
        else:
            assert key is not None and options[key] is True, f"a value without an option: {word}"
            options[key] = word
    fields: dict[str, object] = {}
    training: dict[str, object] = {}
    for name, value in options.items():
        if name in ("swiglu", "group_query_attention", "untie_embeddings_and_output_weights",
                    "num_layers_per_virtual_pipeline_stage", "disable_bias_linear",
                    "no_gradient_accumulation_fusion"):  # fmt: skip
            continue
        if name in TRAINING:
            training[name] = value
            continue
        assert name in fields_of, f"--{name.replace('_', '-')} is no option the export may write"
        kind = str(fields_of[name].type)
        fields[name] = int(value) if "int" in kind and isinstance(value, str) else value
    if options.get("swiglu"):
        fields |= {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}
    if options.get("disable_bias_linear"):
        fields["add_bias_linear"] = False
    # Megatron-LM's store_false option for the field (its default is True there).
    fields["gradient_accumulation_fusion"] = not options.get("no_gradient_accumulation_fusion")
    if not options.get("group_query_attention"):
        fields.pop("num_query_groups", None)
    if "num_layers_per_virtual_pipeline_stage" in options:
        per_stage = int(str(options["num_layers"])) // int(
            str(options["pipeline_model_parallel_size"])
        )
        chunk = int(str(options["num_layers_per_virtual_pipeline_stage"]))
        assert per_stage % chunk == 0, "Megatron-LM asserts a stage's layers split into chunks"
        fields["virtual_pipeline_model_parallel_size"] = per_stage // chunk
    if options.get("bf16"):
        fields |= {"params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class(**fields), training


def launch(model: str, config: TrainConfig, **fields: object) -> Launch:
    spec = resolve_model(model)
    values: dict[str, object] = dict(
        model=model, hidden_size=spec.hidden_size, config=config, micro_batch_size=1,
        grad_accum=4, world_size=8, seq_len=4096, spec=spec,
    )  # fmt: skip
    values.update(fields)
    return Launch(**values)  # type: ignore[arg-type]


def layout(**fields: object) -> TrainConfig:
    values: dict[str, object] = {"engine": Engine.DDP, "zero_stage": 0}
    values.update(fields)
    return TrainConfig(**values)  # type: ignore[arg-type]


LAYOUTS = {
    "tp2 pp2x2 interleaved, every 2nd block": launch(
        "llama3.1-8b",
        layout(tp=2, pp=2, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2, ac_every=2),
    ),
    "fsdp2 tp2 cp2, every block": launch(
        "llama3.1-8b",
        layout(engine=Engine.FSDP, zero_stage=3, tp=2, cp=2, ac_every=1),
        seq_len=16384,
        micro_batch_size=2,
        grad_accum=2,
    ),
    "qwen2 pp4 1f1b on two nodes": launch("qwen2.5-7b", layout(pp=4), world_size=16, nodes=2),
    "fsdp2 data parallel": launch(
        "mistral-7b", layout(engine=Engine.FSDP, zero_stage=3), micro_batch_size=2
    ),
}


def megatron_lm_refusals(argv: list[str], environment: dict[str, str | None]) -> list[str]:
    """What Megatron-LM's ``validate_args`` (core_v0.16.1, ``megatron/training/arguments.py``)
    refuses of these arguments on a Hopper GPU, for the options the export writes: its FSDP2
    checks (no pipeline, no distributed optimizer, no fused gradient accumulation, untied
    embeddings, no fp16, ``CUDA_DEVICE_MAX_CONNECTIONS`` not 1), and tensor or context
    parallelism without FSDP asking ``CUDA_DEVICE_MAX_CONNECTIONS=1``. Written from its text
    here because Megatron-LM's ``megatron.training`` is not on PyPI (megatron-core is)."""
    words = set(argv)

    def value(option: str, default: str) -> str:
        return argv[argv.index(option) + 1] if option in words else default

    connections = environment.get("CUDA_DEVICE_MAX_CONNECTIONS")
    refused = []
    if "--use-torch-fsdp2" in words:
        if value("--pipeline-model-parallel-size", "1") != "1":
            refused.append("--use-torch-fsdp2 is not supported with pipeline parallelism")
        if "--use-distributed-optimizer" in words:
            refused.append("--use-torch-fsdp2 is not supported with MCore's distributed optimizer")
        if "--no-gradient-accumulation-fusion" not in words:
            refused.append("--use-torch-fsdp2 is not supported with gradient accumulation fusion")
        if "--untie-embeddings-and-output-weights" not in words:
            refused.append("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
        if "--fp16" in words:
            refused.append("--use-torch-fsdp2 not supported with fp16 yet")
        if connections == "1":
            refused.append("FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one")
    elif (
        value("--tensor-model-parallel-size", "1") != "1"
        or value("--context-parallel-size", "1") != "1"
    ) and connections != "1":
        refused.append(
            "Using tensor model parallelism or context parallelism require setting the "
            "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"
        )
    return refused


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_core_reads_every_layout_as_autotune_measured_it(name: str) -> None:
    exported = LAYOUTS[name]
    config = exported.config
    spec = exported.spec
    assert spec is not None
    check_layout(config, spec, world_size=exported.world_size, gpus_per_node=exported.per_node,
                 seq_len=exported.seq_len)  # fmt: skip
    read, training = megatron_config(megatron_arguments(exported))
    environment = megatron_environment(exported)
    assert megatron_lm_refusals(megatron_arguments(exported), environment) == []
    script = render(exported, Format.MEGATRON).splitlines()
    for variable, value in environment.items():
        assert (f"unset {variable}" if value is None else f"export {variable}={value}") in script
    # The layout, as megatron-core holds it.
    assert read.tensor_model_parallel_size == config.tp
    assert read.sequence_parallel is (config.tp > 1)
    assert read.pipeline_model_parallel_size == config.pp
    assert (read.virtual_pipeline_model_parallel_size or 1) == config.pp_virtual
    assert read.context_parallel_size == config.cp
    assert training.get("use_torch_fsdp2", False) is (config.engine is Engine.FSDP)
    # The model's shape: the parameters autotune counted.
    assert (read.num_layers, read.hidden_size, read.ffn_hidden_size) == (
        spec.num_layers, spec.hidden_size, spec.intermediate_size)  # fmt: skip
    assert (read.num_attention_heads, read.num_query_groups, read.kv_channels) == (
        spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)  # fmt: skip
    assert read.gated_linear_unit and not read.add_bias_linear
    assert read.add_qkv_bias is (spec.model_type == "qwen2")
    assert read.bf16 and read.params_dtype is torch.bfloat16
    # Checkpointing: megatron-core's recompute fields, the same count of whole blocks.
    chunk = spec.num_layers // (config.pp * config.pp_virtual)
    if config.ac_every == 0:
        assert read.recompute_granularity is None
    else:
        assert read.recompute_granularity == "full"
        recomputed = chunk if read.recompute_method == "uniform" else read.recompute_num_layers
        assert recomputed == len(range(0, chunk, config.ac_every))
    # The batch: Megatron-LM's microbatches a step (global over micro-batch x data parallel)
    # are the accumulation autotune measured, and the interleaved schedule's rule holds.
    micro, total = int(str(training["micro_batch_size"])), int(str(training["global_batch_size"]))
    dp = data_parallel(config, exported.world_size)
    assert micro == exported.micro_batch_size and total % (micro * dp) == 0
    assert total // (micro * dp) == exported.grad_accum
    assert pipeline_microbatches_ok(config, exported.grad_accum)
    assert int(str(training["seq_length"])) == exported.seq_len


def test_the_script_starts_every_rank_of_a_node_with_the_arguments(tmp_path: Path) -> None:
    """The exported script, run by ``sh`` under the real ``torchrun``: each of a node's ranks
    gets Megatron-LM's arguments, word for word, and the user's own after them. The stand-in
    for ``pretrain_gpt.py`` records its rank and arguments."""
    exported = launch("llama3.1-8b", layout(engine=Engine.FSDP, zero_stage=3, tp=2), world_size=2)
    script = tmp_path / "megatron.sh"
    script.write_text(render(exported, Format.MEGATRON))
    stand_in = tmp_path / "pretrain_gpt.py"
    stand_in.write_text(
        "import json, os, sys\n"
        "path = os.path.join(os.environ['RECORD'], os.environ['RANK'] + '.json')\n"
        "seen = os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')\n"
        "open(path, 'w').write(json.dumps([seen, *sys.argv[1:]]))\n"
    )
    (tmp_path / "ranks").mkdir()
    env = {
        **os.environ,
        # As a Megatron-LM launcher of TP jobs often leaves it: FSDP2 refuses it.
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PRETRAIN_GPT": str(stand_in),
        "RECORD": str(tmp_path / "ranks"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["sh", str(script), "--data-path", "my data"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    given = [json.loads((tmp_path / "ranks" / f"{r}.json").read_text()) for r in range(2)]
    expected = [None, *megatron_arguments(exported), "--data-path", "my data"]
    assert given == [expected] * 2
    read, training = megatron_config(given[0][1:-2])
    assert read.tensor_model_parallel_size == 2 and training["use_torch_fsdp2"] is True
    assert megatron_lm_refusals(given[0][1:-2], {"CUDA_DEVICE_MAX_CONNECTIONS": given[0][0]}) == []
    assert not read.gradient_accumulation_fusion


def test_megatron_core_refuses_no_tensor_degree_autotune_accepts() -> None:
    """Heads over TP: every degree autotune's layout check accepts, megatron-core's config
    accepts; where the attention heads do not split, both refuse. (autotune refuses more: its
    probes split the key/value heads too, as torch's and torchtitan's plans do.)"""
    spec = resolve_model("qwen2.5-7b")  # 28 heads, 4 key/value heads
    accepted: list[bool] = []
    for tp in range(1, 29):
        try:
            check_layout(layout(tp=tp), spec, world_size=tp, gpus_per_node=tp, seq_len=4096)
            ours = True
        except ConfigError:
            ours = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                transformer_config()(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                                  num_attention_heads=spec.num_attention_heads,
                                  num_query_groups=spec.num_key_value_heads,
                                  tensor_model_parallel_size=tp)  # fmt: skip
            theirs = True
        except ValueError:
            theirs = False
        assert theirs or not ours, tp
        if spec.num_attention_heads % tp:
            assert not theirs and not ours, tp
        accepted.append(ours)
    # The divisors of both 28 and 4: the degrees the layout check's message suggests.
    assert [tp for tp, ok in enumerate(accepted, start=1) if ok] == [1, 2, 4]


REFUSED = {
    "GPipe": (layout(pp=2, pp_schedule=Schedule.GPIPE), "not GPipe"),
    "DeepSpeed": (TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3), "without DeepSpeed"),
    "offload": (
        TrainConfig(engine=Engine.FSDP, zero_stage=3, offload=Offload.PARAMS),
        "no ZeRO offload",
    ),
    "FSDP2 under a pipeline": (layout(engine=Engine.FSDP, zero_stage=3, pp=2), "runs no pipeline"),
    "FSDP2 ZeRO-2": (TrainConfig(engine=Engine.FSDP, zero_stage=2), "always reshards"),
    "FSDP2 with tied embeddings": (
        TrainConfig(engine=Engine.FSDP, zero_stage=3),
        "needs untied embeddings",
    ),
    "pure bf16": (layout(precision=Precision.BF16), "fp32 main weights"),
    "the chunked loss": (layout(loss=Loss.CHUNKED), "no setting for the chunked loss"),
    "uneven stages": (layout(pp=3), "do not split into 3 pipeline chunks"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_megatron_cannot_run_as_measured_is_refused_in_one_line(case: str) -> None:
    config, says = REFUSED[case]
    model = "qwen2.5-1.5b" if "tied" in case else "llama3.1-8b"
    with pytest.raises(ConfigError) as refused:
        render(launch(model, config, world_size=6 if config.pp == 3 else 8), "megatron")
    message = str(refused.value)
    assert says in message and message.startswith("--format megatron: "), message
    assert "\n" not in message


def test_the_other_formats_refuse_a_layout_and_name_megatron() -> None:
    exported = LAYOUTS["tp2 pp2x2 interleaved, every 2nd block"]
    for fmt in (Format.TORCHRUN, Format.ACCELERATE, Format.HF):
        with pytest.raises(ConfigError, match=r"writes data parallelism alone.*--format megatron"):
            render(exported, fmt)

"""What a study holds: ``best``, ``trials``, ``export``, ``report``; ``models``, the presets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from autotune.cli._app import UsageError, console, errors, print_json, quiet_optuna
from autotune.cli.options import (
    FilterGlobalBatch,
    FilterGpu,
    FilterGpus,
    FilterModel,
    FilterSeqLen,
    FilterStudy,
    ForceOption,
    JsonOption,
    StorageOption,
)
from autotune.study.fingerprint import DEFAULT_STORAGE

if TYPE_CHECKING:
    pass


def best(
    model: FilterModel = None,
    gpu: FilterGpu = None,
    gpus: FilterGpus = None,
    seq_len: FilterSeqLen = None,
    global_batch: FilterGlobalBatch = None,
    storage: StorageOption = DEFAULT_STORAGE,
    json_output: JsonOption = False,
) -> None:
    """The best configuration found so far, per study (workload x hardware x software)."""
    from autotune import api
    from autotune.report.tables import best_table

    studies = api.best(
        **_filters(model, gpu, gpus, seq_len, global_batch),
        storage=storage,
        last=0,
    )
    if json_output:
        print_json(
            [
                {
                    "study": s.study_name,
                    "fingerprint": s.fingerprint.to_dict(),
                    "trials": s.trial_count,
                    "best": s.best.to_dict() if s.best else None,
                }
                for s in studies
            ]
        )
    else:
        console.print(best_table((s.study_name, s.best, s.trial_count) for s in studies))
    raise typer.Exit(0 if any(s.best for s in studies) else 1)


def _filters(
    model: str | None,
    gpu: str | None,
    gpus: int | None,
    seq_len: int | None,
    global_batch: int | None,
) -> dict[str, Any]:
    """The options that select studies, as the library's functions take them."""
    return {
        "model": model,
        "gpu": gpu,
        "gpus": gpus,
        "seq_len": seq_len,
        "global_batch": global_batch,
    }


TRIALS_SHOWN = 50
"""Trials per study ``autotune trials`` shows as a table unless asked for more: a study of
10,000 trials takes seconds to lay out in full."""


def trials(
    model: FilterModel = None,
    gpu: FilterGpu = None,
    gpus: FilterGpus = None,
    seq_len: FilterSeqLen = None,
    global_batch: FilterGlobalBatch = None,
    storage: StorageOption = DEFAULT_STORAGE,
    last: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"Only the last N trials of each study (the table's default: "
            f"{TRIALS_SHOWN}; --json: all).",
        ),
    ] = None,
    every: Annotated[bool, typer.Option("--all", help="Every trial, in the table too.")] = False,
    json_output: JsonOption = False,
) -> None:
    """Every probe of every matching study: configuration, size, outcome, speed, memory."""
    from autotune import api
    from autotune.report.tables import trials_table

    if every and last is not None:
        raise UsageError("--all and --last: give one of them")
    if last is None and not every and not json_output:
        last = TRIALS_SHOWN
    studies = api.trials(
        **_filters(model, gpu, gpus, seq_len, global_batch),
        storage=storage,
        last=last,
        best=False,
    )
    shown = {s.study_name: sorted(s.measurements, key=lambda m: m.number) for s in studies}
    if json_output:
        print_json(
            [
                {"study": s.study_name, "trials": [m.to_dict() for m in shown[s.study_name]]}
                for s in studies
            ]
        )
        return
    for s in studies:
        console.print(trials_table(s.study_name, shown[s.study_name], total=s.trial_count))


def export(
    format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="deepspeed, accelerate, hf, torchrun, fsdp, megatron or torchtitan; for a run "
            "--script study: "
            "command (your script's command line, tuned); for a run --rlhf study: trl, "
            "openrlhf or verl.",
            show_default=False,
        ),
    ],
    model: FilterModel = None,
    gpu: FilterGpu = None,
    gpus: FilterGpus = None,
    seq_len: FilterSeqLen = None,
    global_batch: FilterGlobalBatch = None,
    study: FilterStudy = None,
    storage: StorageOption = DEFAULT_STORAGE,
    trial: Annotated[
        int | None, typer.Option(min=0, help="Export this trial instead of the best.")
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="Export the best configuration of this engine: deepspeed, fsdp, ..."),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write this file (default: stdout).")
    ] = None,
    force: ForceOption = False,
    json_output: JsonOption = False,
) -> None:
    """The best configuration in a trainer's own format.

    DeepSpeed JSON, accelerate YAML, TrainingArguments, a torchrun line, FSDP2 code,
    Megatron-LM's arguments or a torchtitan module (megatron, torchtitan: tensor, pipeline and
    context parallel layouts too), your script's own command line (command), or an RL
    trainer's configuration (trl, openrlhf, verl)."""
    from autotune import api
    from autotune.handoff.launch import Format
    from autotune.handoff.rlhf import RLFormat

    if format not in set(Format) | set(RLFormat):
        choices = ", ".join([*(f.value for f in Format), *(f.value for f in RLFormat)])
        raise UsageError(f"unknown export format {format!r}: use one of {choices}")
    if output is not None:
        api.check_output(output, force=force)
    if format in set(RLFormat):
        asked = (trial, engine, gpu, gpus, seq_len, global_batch)
        if any(value is not None for value in asked):
            raise UsageError(
                f"--format {format} exports an RLHF study's best layout: leave out --trial, "
                "--engine, --gpu, --gpus, --seq-len and --global-batch (name the study with "
                "--study or its policy with --model)"
            )
        quiet_optuna()
        rl = api.export_rlhf(format, model=model, study=study, storage=storage)
        what = (
            f"{format} for {rl.trial.config.label()}, rollout share {rl.trial.share:.0%} "
            f"(trial {rl.trial.number} of {rl.study})"
        )
        _hand_over(rl.to_dict(), rl.text, rl.notes, what, output, force=force, json=json_output)
        return
    found = api.export(
        format,
        **_filters(model, gpu, gpus, seq_len, global_batch),
        study=study,
        storage=storage,
        trial=trial,
        engine=engine,
    )
    if found.chosen is not None and not json_output:
        errors.print(f"read {found.study}: {found.chosen}", markup=False, highlight=False)
    what = (
        f"{found.format.value} for {found.launch.config.label()} at micro-batch "
        f"{found.launch.micro_batch_size} (trial {found.measurement.number} of {found.study})"
    )
    _hand_over(
        found.to_dict(), found.text, found.notes, what, output, force=force, json=json_output
    )


def _hand_over(
    summary: dict[str, Any],
    text: str,
    notes: list[str],
    what: str,
    output: Path | None,
    *,
    force: bool,
    json: bool,
) -> None:
    """An export's text to ``output`` (refused over a file without ``force``) or stdout, its
    notes on stderr; with ``json``, the summary and where the text went, on stdout."""
    from autotune import api

    if output is not None:
        api.write_new_file(output, text, force=force)
    if json:
        print_json({**summary, "output": str(output) if output else None})
        return
    for note in notes:
        errors.print(f"note: {note}", markup=False, highlight=False)
    if output is None:
        from autotune.report.tables import printable

        # To a terminal, shown printable; to a pipe or a file, the export's own bytes.
        sys.stdout.write(printable(text) if sys.stdout.isatty() else text)
    else:
        errors.print(f"wrote {output}: {what}", markup=False, highlight=False)


def report(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The HTML file to write.", show_default=False)
    ],
    model: FilterModel = None,
    gpu: FilterGpu = None,
    gpus: FilterGpus = None,
    seq_len: FilterSeqLen = None,
    global_batch: FilterGlobalBatch = None,
    study: FilterStudy = None,
    storage: StorageOption = DEFAULT_STORAGE,
    budget: Annotated[
        str | None, typer.Option(help="The search's budget, e.g. 30m, drawn on its chart.")
    ] = None,
    force: ForceOption = False,
    json_output: JsonOption = False,
) -> None:
    """One self-contained HTML page of a study (works offline).

    Memory per GPU, tokens/s and MFU against micro-batch, the search's path, the best
    configuration and its launch, and every probe."""
    from autotune import api

    done = api.write_report(
        output,
        **_filters(model, gpu, gpus, seq_len, global_batch),
        study=study,
        storage=storage,
        budget=budget,
        force=force,
    )
    if json_output:
        print_json(done.to_dict())
    else:
        why = f" ({done.chosen})" if done.chosen else ""
        errors.print(f"wrote {done.path}: {done.study}{why}", markup=False, highlight=False)


def models(json_output: JsonOption = False) -> None:
    """List the model presets with their parameter counts."""
    from autotune.models import preset_names, resolve_model
    from autotune.report.tables import models_table

    specs = [resolve_model(name) for name in preset_names()]
    if json_output:
        print_json(
            [
                {
                    "name": spec.name,
                    "params": spec.num_params,
                    "layers": spec.num_layers,
                    "hidden": spec.hidden_size,
                    "heads": spec.num_attention_heads,
                    "kv_heads": spec.num_key_value_heads,
                    "vocab": spec.vocab_size,
                    "flops_per_token_2k": spec.flops_per_token(2048),
                }
                for spec in specs
            ]
        )
        return
    console.print(models_table(specs))

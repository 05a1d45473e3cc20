"""``autotune run``: the search (or an RL iteration's layouts, or a job file's workloads)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from autotune.cli._app import (
    RLHF_OPTIONS,
    UsageError,
    allowed_lora,
    as_flags,
    console,
    errors,
    print_json,
    quiet_optuna,
    rlhf_options,
    script_options,
    sigterm_interrupts,
)
from autotune.cli.options import (
    AccumFlagOption,
    BatchFlagOption,
    CheckpointingFlagOption,
    CriticOption,
    EngineOption,
    FrameworkOption,
    FrozenOption,
    GlobalBatchOption,
    HeadroomOption,
    HostCoresOption,
    HostMemoryOption,
    HostsOption,
    NodesOption,
    ReferenceOption,
    ResponseLenOption,
    RewardOption,
    RlhfOption,
    RolloutBatchOption,
    RolloutShareOption,
    RunCpOption,
    RunPpOption,
    RunPpScheduleOption,
    RunPpVirtualOption,
    RunTpOption,
    ScriptArgs,
    ScriptOption,
    SeqLenOption,
    SleepOption,
    StorageOption,
)
from autotune.config import LORA_RANK, Attention, ConfigError, Precision
from autotune.study.fingerprint import DEFAULT_STORAGE
from autotune.tuned.script import Framework, ScriptJob
from autotune.units import format_duration
from autotune.urls import masked
from autotune.values import api_arguments, engines_value

if TYPE_CHECKING:
    from autotune import api
    from autotune.jobs import Freshness, Job, JobResult
    from autotune.search.controller import Event, RunSummary
    from autotune.study.measurement import PredictionGap


def _run_rlhf(algorithm: str, model: str, *, json_output: bool, **options: Any) -> None:
    """``autotune run --rlhf``: probe layouts of an RL iteration, a line a probe, then the
    best (or the summary as JSON)."""
    from autotune import api
    from autotune.tuned.rlhf import Placement

    quiet_optuna()
    shown = errors if json_output else console

    def said(trial: Any, row: Any, best: Any) -> None:
        what = (
            f"{trial.samples_per_second:,.2f} samples/s"
            if trial.feasible
            else f"[red]{trial.outcome}[/] at {trial.stage or '?'}"
        )
        lead = f"best {best.samples_per_second:,.2f} samples/s" if best else "nothing fits yet"
        shown.print(
            f"probe: {trial.config.label()}, share {trial.share:.0%}"
            f"{', asleep' if trial.sleep else ''}"
            f"{', frozen on the host' if trial.frozen is Placement.OFFLOAD else ''}, micro-batch "
            f"{trial.micro_batch_size} "
            f"(predicted {'fits' if row.fits else 'may fit'}): {what}; {lead}"
        )

    summary = api.tune_rlhf(algorithm, model, on_probe=said, **options)
    if json_output:
        print_json(summary.to_dict())
        return
    count = f"{summary.probes} probe{'' if summary.probes == 1 else 's'}"
    console.print(f"stopped: {summary.stop_reason}; {count} this run; study {summary.study}")
    best = summary.best
    if best is None:
        console.print(summary.why_no_best, style="red", markup=False, highlight=False)
        raise typer.Exit(1)
    console.print(
        f"best: {best.config.label()}, rollout share {best.share:.0%}"
        f"{', engine asleep while training' if best.sleep else ''}, micro-batch "
        f"{best.micro_batch_size}: {best.samples_per_second:,.2f} samples/s (rollout "
        "predicted: the engine is emulated)"
    )


def run(
    model: Annotated[
        str | None,
        typer.Option(help="Preset name or path to a config.json (default: llama-7b)."),
    ] = None,
    budget: Annotated[str, typer.Option(help="Wall-clock budget: 30m, 1h30m, 90s.")] = "30m",
    seq_len: SeqLenOption = None,
    global_batch: GlobalBatchOption = None,
    gpus: Annotated[
        int | None, typer.Option(help="GPUs (default: all here; 1 on the CPU).")
    ] = None,
    nodes: NodesOption = None,
    hosts: HostsOption = None,
    engine: EngineOption = None,
    tp: RunTpOption = None,
    pp: RunPpOption = None,
    cp: RunCpOption = None,
    pp_schedule: RunPpScheduleOption = None,
    pp_virtual: RunPpVirtualOption = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Default: bf16-mixed, fp16-mixed without bf16.")
    ] = None,
    attention: Annotated[Attention, typer.Option()] = Attention.SDPA,
    loss: Annotated[
        str | None,
        typer.Option(
            "--loss",
            help="Losses to search, comma-separated: full (the model's own, the default), "
            "chunked (the logits a chunk at a time, where it pays), fused (Liger-Kernel, GPUs).",
        ),
    ] = None,
    ac_ops: Annotated[
        bool,
        typer.Option(
            "--ac-ops/--no-ac-ops",
            help="Search op-level selective checkpointing (ac:ops) too, where it fits a larger "
            "micro-batch.",
        ),
    ] = False,
    act_offload: Annotated[
        bool,
        typer.Option(
            "--act-offload/--no-act-offload",
            help="Search activation offload (act:host: the blocks' saved tensors in pinned host "
            "memory) too, where it fits a larger micro-batch.",
        ),
    ] = False,
    optimizer: Annotated[
        str | None,
        typer.Option(
            "--optimizer",
            help="Optimizers to search, comma-separated: adamw (torch's fused AdamW, the "
            "default), adamw-8bit (torchao's 8-bit moments, where it pays).",
        ),
    ] = None,
    allow: Annotated[
        str | None,
        typer.Option(
            "--allow",
            help="Trainings other than full fine-tuning the search may fall back on: lora "
            "(peft's adapters on every linear layer of the blocks, the rest frozen), probed "
            "once no full fine-tuning configuration is left that may fit.",
        ),
    ] = None,
    lora_rank: Annotated[int, typer.Option(help="LoRA's rank with --allow lora.")] = LORA_RANK,
    simulate: Annotated[
        str | None, typer.Option(help="Probe a simulated GPU (the estimator), e.g. h100-80gb.")
    ] = None,
    device: Annotated[str, typer.Option(help="cuda, cpu (real CPU probes) or auto.")] = "auto",
    device_memory: Annotated[
        str | None, typer.Option(help="Memory cap per device, e.g. 20GiB (needed on the CPU).")
    ] = None,
    headroom: HeadroomOption = "0%",
    host_memory: HostMemoryOption = None,
    host_cores: HostCoresOption = None,
    objective: Annotated[
        str, typer.Option(help="What to maximize: tokens (tokens/s) or mfu.")
    ] = "tokens",
    storage: StorageOption = DEFAULT_STORAGE,
    trials_dir: Annotated[Path, typer.Option(help="Where probe folders go.")] = Path("trials"),
    seed: Annotated[int, typer.Option(help="Seed of the simulated device's noise.")] = 0,
    warm: Annotated[
        bool,
        typer.Option(
            help="Fork probe ranks from a warm process that imported torch once; --no-warm: "
            "each rank a fresh interpreter."
        ),
    ] = True,
    jobs: Annotated[
        Path | None,
        typer.Option(
            help="A job file (YAML, workloads: list): tune each workload in turn, the other "
            "options applying to those that do not set them.",
            show_default=False,
        ),
    ] = None,
    max_age: Annotated[
        str | None,
        typer.Option(
            help="With --jobs: tune again a result older than this, e.g. 7d (default: a "
            "result stands while nothing changed)."
        ),
    ] = None,
    script: ScriptOption = None,
    framework: FrameworkOption = None,
    batch_flag: BatchFlagOption = None,
    accum_flag: AccumFlagOption = None,
    checkpointing_flag: CheckpointingFlagOption = None,
    script_args: ScriptArgs = None,
    rlhf: RlhfOption = None,
    rollout_share: RolloutShareOption = None,
    sleep: SleepOption = None,
    frozen: FrozenOption = None,
    reference: ReferenceOption = None,
    critic: CriticOption = None,
    reward: RewardOption = None,
    rollout_batch: RolloutBatchOption = None,
    response_len: ResponseLenOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
) -> None:
    """Find the fastest configuration that fits: probe, escalate, record every trial.

    With --rlhf: the fastest layout of an RL iteration (engine share, sleep, trainer), each
    probe an iteration with the engine's share held."""

    given = dict(locals())  # the options by parameter name: nothing else is bound yet
    rl_options = rlhf_options(
        rlhf, ("tunes", "tuned"), as_flags(given, RLHF_OPTIONS), as_flags(given, _NOT_RLHF)
    )
    if rlhf is not None:
        shared = {name: given[name] for name in _RLHF_SHARED}
        engines = engines_value(engine)
        _run_rlhf(
            rlhf,
            model or "llama-7b",
            engines=engines,
            json_output=json_output,
            **shared,
            **rl_options,
        )
        return
    quiet_optuna()
    options = _job_defaults(given)
    script_job = script_options(given)
    if jobs is not None:
        if model is not None:
            raise UsageError("--model and --jobs: name each workload's model in the job file")
        if script_job:
            raise UsageError("--script and --jobs: name each workload's script in the job file")
        if any(given[name] is not None for name in _LAYOUT):
            raise UsageError("--tp, --pp and --cp tune one workload: leave them out with --jobs")
        _run_jobs(jobs, max_age=max_age, json_output=json_output, **options)
    if max_age is not None:
        raise UsageError("--max-age applies to --jobs: a single run always tunes")
    if not script_job and model is None:
        model = "llama-7b"
    layout = {name: given[name] for name in _LAYOUT if given[name] is not None}
    _search(model, api_arguments(options) | script_job | layout, json_output=json_output)


_LAYOUT = ("tp", "pp", "cp", "pp_schedule", "pp_virtual")
"""``run``'s options of the layout it keeps (a single search's, passed to the API as named)."""

_NOT_RLHF = (
    *_LAYOUT,
    "jobs",
    "script",
    "simulate",
    "global_batch",
    "loss",
    "optimizer",
    "allow",
    "nodes",
    "hosts",
)
"""``run``'s options an RL iteration's search does not take, refused with ``--rlhf``."""

_RLHF_SHARED = (
    "device",
    "device_memory",
    "gpus",
    "seq_len",
    "precision",
    "budget",
    "storage",
    "trials_dir",
)
"""``run``'s options an RL iteration's search takes as the search does."""

_PASSED = (
    "budget",
    "seq_len",
    "global_batch",
    "gpus",
    "nodes",
    "hosts",
    "engine",
    "precision",
    "attention",
    "loss",
    "optimizer",
    "simulate",
    "device",
    "device_memory",
    "headroom",
    "host_memory",
    "host_cores",
    "objective",
    "storage",
    "seed",
    "warm",
)
"""``run``'s options a job file's workload takes under the same name."""


def _job_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The run's options as a job file names them: a workload's own fields override them."""
    return {name: given[name] for name in _PASSED} | {
        "ac_ops": True if given["ac_ops"] else None,  # a workload may set it
        "act_offload": True if given["act_offload"] else None,
        "lora_rank": given["lora_rank"] if allowed_lora(given["allow"]) else None,
        "trials_dir": str(given["trials_dir"]),
    }


def _search(model: str | None, options: dict[str, Any], *, json_output: bool) -> NoReturn:
    """One search with the run's options (as :func:`autotune.api.prepare` takes them), its
    progress on the terminal (on stderr with ``--json``); exits with the run's code."""
    from autotune import api
    from autotune.report.live import RunView
    from autotune.report.tables import ranks_text
    from autotune.study.measurement import prediction_gap

    tuning = api.prepare(model, **options)
    simulated = tuning.device.kind == "simulated"
    w = tuning.workload
    # With --json, stdout is the summary alone: the progress goes to stderr.
    shown = errors if json_output else console
    job = tuning.template.script
    cpu = tuning.template.device == "cpu"
    ranks = "" if job is None else f"{_job_ranks(job, options['warm'], cpu)}{_own(job)}"
    if job is not None and w.job_engines is not None:
        found = w.job_engines_text()
        ranks += f"; the engines it trains under when asked, as its probes found: {found}"
    how = "" if job is None else f"; probes run {job.name} ({ranks})"
    shown.print(
        f"tuning {tuning.model.name} on {ranks_text(tuning.template)} x {tuning.gpu.name}"
        f"{' (simulated)' if simulated else ''}, seq {w.seq_len}, global batch "
        f"{w.global_batch}{how}; study [bold]{tuning.fingerprint.study_name}[/] in "
        f"{masked(options['storage'])}",
        markup=True,
    )
    if tuning.climbed is not None:
        shown.print(tuning.climbed, markup=False, highlight=False)
    view = RunView(
        shown,
        budget_s=tuning.budget_s,
        simulated=simulated,
        objective=tuning.fingerprint.objective,
        job=job is not None,
    )
    with sigterm_interrupts(), view:
        summary = tuning.run(view)
    gap = None
    if job is not None:
        gap = prediction_gap(summary.measurements)
    _said(summary, tuning, gap, json_output=json_output)
    if summary.interrupted:
        raise typer.Exit(143 if summary.interrupted == "SIGTERM" else 130)
    if summary.mistake:
        raise ConfigError(summary.stop_reason)
    raise typer.Exit(0 if summary.best and not summary.failure else 1)


def _said(
    summary: RunSummary, tuning: api.Tuning, gap: PredictionGap | None, *, json_output: bool
) -> None:
    """A finished search's result: ``--json``'s summary, or the ranking, why it stopped, the
    best and, for a user's job, how its speed compares with the stand-in's."""
    from autotune.report.live import speed_text
    from autotune.report.tables import ranking_table

    if json_output:
        extra: dict[str, Any] = {} if gap is None else {"prediction_gap": gap.to_dict()}
        if tuning.climbed is not None:
            extra["climbed"] = tuning.climbed
        print_json({"study": tuning.fingerprint.study_name, **summary.to_dict(), **extra})
    elif summary.mistake:
        pass  # one line, below: the job's own mistake is bad input
    else:
        if summary.best is not None:  # an empty table says nothing
            console.print(ranking_table(summary.measurements, tuning.capacity_bytes))
        count = f"{summary.probes} probe{'' if summary.probes == 1 else 's'}"
        used = f"{format_duration(summary.elapsed_s)} of its {format_duration(tuning.budget_s)}"
        console.print(f"stopped: {summary.stop_reason}; {count} this run, {used} budget")
        best = summary.best
        if best is None:
            console.print(f"[red]{summary.why_no_best}[/]")
        else:
            console.print(
                f"[bold]best: {best.config.label()} at micro-batch {best.micro_batch_size} "
                f"(accumulation {best.grad_accum}): {speed_text(best)}[/]"
            )
        if gap is not None:
            console.print(
                f"your job ran at {gap.text()} for autotune's stand-in{gap.loss_note()}",
                markup=False,
                highlight=False,
            )


def _own(job: ScriptJob) -> str:
    """The script's own flags autotune sets, for the run's first line."""
    flags = (
        (job.batch_flag, "micro-batch"),
        (job.accum_flag, "accumulation"),
        (job.checkpointing_flag, "checkpointing"),
    )
    named = [f"{flag} ({knob})" for flag, knob in flags if flag]
    own = f"; its own flags {', '.join(named)}" if named else ""
    if not job.checkpoints:
        own += (
            "; no checkpointing: it has no switch for it (name one with --checkpointing-flag) "
            "and reads no autotune.job_config(), so configurations that checkpoint are not tried"
        )
    return own


def _job_ranks(job: ScriptJob, warm: bool, cpu: bool) -> str:
    """How a job's ranks start, for the run's first line."""
    if job.framework is Framework.ACCELERATE:
        started = "accelerate launch starts its ranks, each a fresh interpreter"
        # accelerate's DeepSpeed path is for accelerators: on the CPU its ranks run as DDP.
        return started + ("; no DeepSpeed: accelerate runs none on the CPU" if cpu else "")
    if warm:
        return f"{job.framework.value} adapter, its ranks forked from warm workers"
    return f"{job.framework.value} adapter, each rank a fresh interpreter"


def _run_jobs(path: Path, *, max_age: str | None, json_output: bool, **defaults: Any) -> NoReturn:
    """``autotune run --jobs``: each workload in turn, a line on why it is tuned or skipped,
    its live view, a table at the end; exit 1 when one failed or found nothing that fits."""
    from autotune import api
    from autotune.report.live import RunView
    from autotune.report.tables import jobs_table

    views = contextlib.ExitStack()

    shown = errors if json_output else console  # with --json, the progress goes to stderr

    def started(job: Job, tuning: api.Tuning, fresh: Freshness) -> Callable[[Event], None] | None:
        shown.print(
            f"[bold]workload {job.index}[/] ({path}:{job.line}) {job.label()}: tuning, "
            f"{fresh.why}; study {tuning.fingerprint.study_name}",
            highlight=False,
        )
        view = RunView(
            shown,
            budget_s=tuning.budget_s,
            simulated=tuning.device.kind == "simulated",
            objective=tuning.fingerprint.objective,
        )
        return views.enter_context(view)

    def ended(result: JobResult) -> None:
        views.close()
        if result.status == "tuned":
            return
        line = f"workload {result.job.index} ({path}:{result.job.line}) {result.job.label()}"
        colour = "red" if result.failed or result.status == "interrupted" else "cyan"
        shown.print(f"[{colour}]{line}: {result.status}[/], {result.why}", highlight=False)

    with sigterm_interrupts():
        results = api.tune_jobs(path, max_age=max_age, on_job=started, on_result=ended, **defaults)
    if json_output:
        print_json(
            {
                "jobs": str(path),
                "workloads": [r.to_dict() for r in results],
                "failed": sum(r.failed for r in results),
            }
        )
    else:
        console.print(jobs_table(results))
    stopped = next((r for r in results if r.status == "interrupted"), None)
    if stopped is not None and stopped.summary is not None:
        raise typer.Exit(143 if stopped.summary.interrupted == "SIGTERM" else 130)
    raise typer.Exit(1 if any(r.failed for r in results) else 0)

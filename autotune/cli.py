"""The ``autotune`` command line.

Every command that prints results also takes ``--json``. Bad input ends with one line that
says what to do, and exit code 2; `autotune probe` exits 0 when at least one micro-batch
size fits, 1 when none does.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Offload,
    Precision,
    TrainConfig,
    parse_ac,
)
from autotune.units import format_bytes, format_duration, parse_duration, parse_size

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="OOM-driven auto-tuner for large-model training: finds the fastest configuration "
    "that fits your GPUs.",
)
# Piped output is read by people too: do not squeeze tables into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(
            f"invalid micro-batch {text!r}: use a positive integer or a list like 1,2,4"
        ) from None
    if not sizes or min(sizes) < 1:
        raise UsageError(
            f"invalid micro-batch {text!r}: use a positive integer or a list like 1,2,4"
        )
    return sizes


def _default_processes(device: str) -> tuple[str, int]:
    """Resolve ``auto`` and the default rank count from the GPUs NVML sees."""
    from autotune.hardware import detect_gpus

    gpus = detect_gpus()
    if device == "cuda" and gpus is None:
        raise UsageError("--device cuda, but no GPU is visible: use --device cpu")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
        if gpus is None:
            errors.print("[yellow]no GPU found: probing on the CPU (--device cuda to insist)[/]")
    return device, (gpus.count if gpus and device == "cuda" else 1)


def _count(n: int) -> str:
    """6.74 B, 124.4 M, 0.2 M: parameter counts the way papers write them."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _fmt(value: float | None, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def _print_result(data: dict[str, Any]) -> None:
    spec = data["spec"]
    config = TrainConfig.from_dict(spec["config"])
    limit = data.get("emulated_device_memory_bytes")
    device = data["device"] + (f" ({data['gpu_name']})" if data.get("gpu_name") else "")
    console.print(
        f"[bold]{spec['model']}[/] seq {spec['seq_len']} · {config.label()} · "
        f"{spec['num_processes']} x {device}"
        + (f" · [magenta]emulated device memory {format_bytes(limit)}[/]" if limit else "")
    )
    table = Table(show_header=True, header_style="bold")
    for column in (
        "micro-batch",
        "outcome",
        "tokens/s",
        "tokens/s/rank",
        "MFU",
        "step",
        "peak alloc",
        "peak reserved",
        "loss",
    ):
        table.add_column(column, justify="right")
    for size in data["sizes"]:
        ok = size["outcome"] == "ok"
        outcome = (
            "[green]ok[/]"
            if ok
            else f"[red]{size['outcome']}[/]" + (f" ({size['stage']})" if size.get("stage") else "")
        )
        losses = size.get("losses") or []
        table.add_row(
            str(size["micro_batch_size"]),
            outcome,
            _fmt(size.get("tokens_per_second"), ",.0f"),
            _fmt(size.get("tokens_per_second_per_rank"), ",.0f"),
            _fmt(size.get("mfu") and 100 * size["mfu"], ".1f") + ("%" if size.get("mfu") else ""),
            format_duration(size["step_s"]) if size.get("step_s") else "-",
            format_bytes(size["peak_allocated_bytes"]) if size.get("peak_allocated_bytes") else "-",
            format_bytes(size["peak_reserved_bytes"]) if size.get("peak_reserved_bytes") else "-",
            f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "-",
        )
    console.print(table)
    colour = "green" if data["outcome"] == "ok" else "red"
    timing = ", ".join(
        f"{name} {format_duration(data[key])}"
        for name, key in (("import", "import_s"), ("build", "build_s"), ("wall", "wall_s"))
        if data.get(key) is not None
    )
    console.print(
        f"outcome [{colour}]{data['outcome']}[/]"
        + (f" at {data['stage']}" if data.get("stage") else "")
        + (f": {data['message']}" if data.get("message") else "")
        + f" · {timing}"
    )
    if data["device"] == "cpu" and not data.get("gpu_name"):
        console.print("[dim]CPU probe: no MFU; memory is live tensor bytes on the host[/]")
    console.print(f"[dim]probe folder {data['probe_dir']}[/]")


@app.command()
def probe(
    model: Annotated[str, typer.Option(help="Preset name or path to a config.json.")] = "tiny",
    engine: Annotated[Engine, typer.Option(help="Training engine.")] = Engine.SINGLE,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage (fsdp: 2 or 3).")] = 0,
    precision: Annotated[Precision, typer.Option()] = Precision.BF16_MIXED,
    offload: Annotated[Offload, typer.Option(help="Model states kept on the CPU.")] = Offload.NONE,
    ac: Annotated[str, typer.Option(help="Activation checkpointing: off, every, every-N.")] = "off",
    attention: Annotated[Attention, typer.Option()] = Attention.SDPA,
    micro_batch: Annotated[str, typer.Option(help="Size, or sizes to sweep: 1,2,4.")] = "1",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 2048,
    grad_accum: Annotated[int, typer.Option(help="Micro-steps per optimizer step.")] = 1,
    gpus: Annotated[int | None, typer.Option(help="Ranks (default: all GPUs, or 1).")] = None,
    device: Annotated[str, typer.Option(help="cuda, cpu or auto.")] = "auto",
    device_memory: Annotated[
        str | None, typer.Option(help="Emulated device-memory cap per rank, e.g. 20GiB.")
    ] = None,
    warmup_steps: Annotated[int, typer.Option()] = 2,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps.")] = 3,
    timeout: Annotated[str, typer.Option(help="Wall-clock limit, e.g. 10m.")] = "10m",
    trials_dir: Annotated[Path, typer.Option(help="Where probe folders go.")] = Path("trials"),
    study: Annotated[str, typer.Option(help="Folder name under trials-dir.")] = "probes",
    json_output: Annotated[bool, typer.Option("--json", help="Print result.json.")] = False,
) -> None:
    """Run a few real training steps of one configuration and report OOM or throughput."""
    from autotune.models import resolve_model
    from autotune.probe import ProbeSpec, launch_probe, new_probe_dir

    resolve_model(model)  # fail fast on an unknown name
    config = TrainConfig(
        engine=engine,
        zero_stage=zero_stage,
        precision=precision,
        offload=offload,
        ac_every=parse_ac(ac),
        attention=attention,
    )
    device, default_ranks = _default_processes(device)
    spec = ProbeSpec(
        model=model,
        config=config,
        micro_batch_sizes=_parse_sizes(micro_batch),
        seq_len=seq_len,
        grad_accum=grad_accum,
        num_processes=gpus
        if gpus is not None
        else (1 if engine is Engine.SINGLE else default_ranks),
        device=device,
        device_memory_bytes=parse_size(device_memory) if device_memory else None,
        warmup_steps=warmup_steps,
        timed_steps=steps,
        timeout_s=parse_duration(timeout),
    )
    probe_dir = new_probe_dir(trials_dir, study)
    if not json_output:
        console.print(
            f"[dim]probing {spec.config.label()} at micro-batch {micro_batch} in {probe_dir} ...[/]"
        )
    running = (
        contextlib.nullcontext()
        if json_output
        else console.status(f"probe running ({spec.num_processes} x {device})")
    )
    with running:
        result = launch_probe(spec, probe_dir)
    data = result.to_dict()
    if json_output:
        print(json.dumps(data, indent=2, default=str))
    else:
        _print_result(data)
    raise typer.Exit(0 if result.ok_sizes() else 1)


def _resolve_gpu(gpu: str | None) -> tuple[Any, int]:
    """The GpuSpec named by ``--gpu`` (or detected here) and the visible GPU count."""
    from autotune.hardware import detect_gpus, gpu_spec

    detected = detect_gpus()
    if gpu is not None:
        return gpu_spec(gpu), detected.count if detected else 1
    if detected is None:
        raise UsageError("no GPU detected: name the target with --gpu h100-80gb (or a .toml file)")
    spec = detected.spec
    if spec is None:
        raise UsageError(
            f"{detected.name} is not in the GPU catalogue: describe it in a .toml file and pass "
            "--gpu that-file.toml (see docs/gpus.md)"
        )
    return spec, detected.count


def _parse_engines(text: str | None) -> list[Engine] | None:
    if not text:
        return None
    try:
        return [Engine(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        choices = ", ".join(e.value for e in Engine)
        raise UsageError(f"unknown engine in {text!r}: use {choices}, comma-separated") from None


def _parse_fraction(text: str) -> float:
    value = text.strip()
    try:
        fraction = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise UsageError(f"invalid headroom {text!r}: use a percentage like 10%") from None
    if not 0.0 <= fraction < 1.0:
        raise UsageError(f"headroom {text!r} must be between 0% and 100%")
    return fraction


@app.command()
def plan(
    model: Annotated[str, typer.Option(help="Preset name or path to a config.json.")] = "llama-7b",
    gpu: Annotated[
        str | None, typer.Option(help="GPU key (h100-80gb, a100-40gb, ...) or a .toml file.")
    ] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs in all (default: those here).")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs sharing a node.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 2048,
    global_batch: Annotated[
        int | None, typer.Option(help="Sequences per optimizer step (default: 8 per GPU).")
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="Only these engines, comma-separated: fsdp,deepspeed.")
    ] = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Default: bf16-mixed, fp16-mixed without bf16.")
    ] = None,
    attention: Annotated[Attention, typer.Option()] = Attention.SDPA,
    headroom: Annotated[str, typer.Option(help="Memory to leave free, e.g. 10%.")] = "0%",
    reserve: Annotated[
        str, typer.Option(help="Device memory kept for CUDA context and allocator.")
    ] = "1GiB",
    top: Annotated[int, typer.Option(help="Rows to show (0: all).")] = 15,
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Rank every configuration by predicted throughput, with predicted peak memory (no GPU)."""
    import time

    from autotune.estimator.plan import plan as make_plan
    from autotune.models import resolve_model
    from autotune.space import Workload

    spec = resolve_model(model)
    gpu_info, here = _resolve_gpu(gpu)
    world = gpus if gpus is not None else here
    workload = Workload(
        seq_len=seq_len,
        global_batch=global_batch if global_batch is not None else 8 * world,
        world_size=world,
    )
    started = time.perf_counter()
    rows = make_plan(
        spec,
        gpu_info,
        workload,
        engines=_parse_engines(engine),
        precision=precision,
        attention=attention,
        gpus_per_node=gpus_per_node,
        reserve=parse_size(reserve),
        headroom=_parse_fraction(headroom),
    )
    elapsed = time.perf_counter() - started
    shown = rows if top <= 0 else rows[:top]
    if json_output:
        print(
            json.dumps(
                {
                    "model": spec.name,
                    "gpu": gpu_info.key,
                    "gpus": world,
                    "seq_len": seq_len,
                    "global_batch": workload.global_batch,
                    "predicted": True,
                    "seconds": elapsed,
                    "rows": [row.to_dict() for row in rows],
                },
                indent=2,
            )
        )
        return
    table = Table(
        "#",
        "configuration",
        "mbs",
        "accum",
        "peak memory",
        "fits",
        "tokens/s",
        "MFU",
        "peak at",
        header_style="bold",
        title=f"{spec.name} on {world} x {gpu_info.name}, seq {seq_len}, global batch "
        f"{workload.global_batch}: predicted, not measured",
    )
    for index, row in enumerate(shown, 1):
        fits = "yes" if row.fits else f"[red]no, {format_bytes(row.over_bytes)} over[/]"
        table.add_row(
            str(index),
            row.config.label(),
            str(row.micro_batch_size),
            str(row.grad_accum),
            format_bytes(row.memory.peak_bytes),
            fits,
            _fmt(row.time.tokens_per_second if row.time else None, ",.0f"),
            _fmt(row.time.mfu if row.time else None, ".1%"),
            row.memory.phase,
        )
    console.print(table)
    fitting = sum(row.fits for row in rows)
    console.print(
        f"[dim]{len(rows)} configurations ({fitting} fit in "
        f"{format_bytes(rows[0].capacity_bytes)} usable per GPU) in {elapsed * 1000:.0f} ms[/]"
    )


def _cpu_device_spec(device_memory: int) -> Any:
    """A GpuSpec standing for the CPU under an emulated device cap (real CPU probes).

    Its speeds only order the first probes; the search rescales predictions by what the
    probes measure. Its memory is the emulated cap.
    """
    from autotune.hardware import GpuSpec

    return GpuSpec(
        key="cpu",
        name="CPU (emulated device memory)",
        memory_bytes=device_memory,
        peak_flops={"bf16": 1e11, "fp16": 1e11, "fp32": 1e11},
        hbm_bandwidth=20e9,
        intra_node_bandwidth=5e9,
        host_link_bandwidth=20e9,
        inter_node_bandwidth=1e9,
        form_factor="pcie",
    )


@app.command()
def run(
    model: Annotated[str, typer.Option(help="Preset name or path to a config.json.")] = "llama-7b",
    budget: Annotated[str, typer.Option(help="Wall-clock budget: 30m, 1h30m, 90s.")] = "30m",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 2048,
    global_batch: Annotated[
        int | None, typer.Option(help="Sequences per optimizer step (default: 8 per GPU).")
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(help="GPUs (default: all here; 1 on the CPU).")
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="Only these engines, comma-separated: fsdp,deepspeed.")
    ] = None,
    simulate: Annotated[
        str | None, typer.Option(help="Probe a simulated GPU (the estimator), e.g. h100-80gb.")
    ] = None,
    device: Annotated[str, typer.Option(help="cuda, cpu (real CPU probes) or auto.")] = "auto",
    device_memory: Annotated[
        str | None, typer.Option(help="Memory cap per device, e.g. 20GiB (needed on the CPU).")
    ] = None,
    headroom: Annotated[str, typer.Option(help="Memory to leave free, e.g. 10%.")] = "0%",
    objective: Annotated[
        str, typer.Option(help="What to maximize: tokens (tokens/s) or mfu.")
    ] = "tokens",
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL.")
    ] = "sqlite:///trials/autotune.db",
    trials_dir: Annotated[Path, typer.Option(help="Where probe folders go.")] = Path("trials"),
    seed: Annotated[int, typer.Option(help="Seed of the simulated device's noise.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable summary.")] = False,
) -> None:
    """Find the fastest configuration that fits: probe, escalate, record every trial."""
    import optuna

    from autotune.estimator.plan import plan as make_plan
    from autotune.estimator.plan import usable_bytes
    from autotune.estimator.simulate import SimulatedDevice
    from autotune.hardware import detect_gpus
    from autotune.models import resolve_model
    from autotune.probe import launch_probe
    from autotune.report.live import RunView, best_table, speed_text
    from autotune.search.controller import Controller
    from autotune.space import Workload
    from autotune.study import Fingerprint, TrialStore

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = resolve_model(model)
    budget_s = parse_duration(budget)
    cap = parse_size(device_memory) if device_memory else None
    found = detect_gpus()
    runner: Any
    if simulate:
        sim = SimulatedDevice.named(simulate, seed=seed)
        gpu_info, kind, world = sim.gpu, "simulated", gpus or 8
        runner, probe_device = sim.launch_probe, "cuda"
        capacity = cap or usable_bytes(sim.gpu)
    else:
        if device == "auto":
            if found is None:
                raise UsageError(
                    "no GPU found: use --device cpu --device-memory 64MiB (real CPU probes) "
                    "or --simulate h100-80gb (the estimator's simulated GPU)"
                )
            device = "cuda"
        if device == "cpu":
            if cap is None:
                raise UsageError("--device cpu needs --device-memory, e.g. 64MiB, to emulate a GPU")
            gpu_info, kind, world = _cpu_device_spec(cap), "cpu", gpus or 1
            capacity = cap
        else:
            gpu_info, here = _resolve_gpu(None)
            kind, world = "cuda", gpus or here
            capacity = cap or usable_bytes(gpu_info)
        runner, probe_device = launch_probe, device
    workload = Workload(
        seq_len=seq_len,
        global_batch=global_batch if global_batch is not None else 8 * world,
        world_size=world,
    )
    fingerprint = Fingerprint(
        model=spec.name,
        seq_len=seq_len,
        global_batch=workload.global_batch,
        gpu=gpu_info.key,
        gpu_memory_bytes=capacity,
        gpus=world,
        device=kind,
        objective=objective,
    )
    if objective == "mfu" and kind == "cpu":
        raise UsageError(
            "--objective mfu needs a GPU's peak FLOP/s: use --objective tokens on the CPU"
        )
    store = TrialStore(fingerprint, workload, storage=storage, headroom=_parse_fraction(headroom))
    rows = make_plan(
        spec,
        gpu_info,
        workload,
        engines=_parse_engines(engine),
        reserve=0 if kind == "cpu" else 1024**3,
    )
    if kind == "cpu":
        rows = [r for r in rows if r.config.offload.value == "none"]  # no host to offload to

    if not json_output:
        console.print(
            f"tuning {spec.name} on {world} x {gpu_info.name}"
            f"{' (simulated)' if kind == 'simulated' else ''}, seq {seq_len}, global batch "
            f"{workload.global_batch}; study [bold]{fingerprint.study_name}[/] in {storage}"
        )
    view = RunView(console, budget_s=budget_s, simulated=kind == "simulated")
    controller = Controller(
        model=spec,
        model_ref=model,
        workload=workload,
        store=store,
        rows=rows,
        runner=runner,
        budget_s=budget_s,
        trials_dir=trials_dir,
        device=probe_device,
        device_memory_bytes=cap,
        capacity_bytes=capacity,
        simulated=kind == "simulated",
        on_event=None if json_output else view,
    )
    with _sigterm_interrupts(), view if not json_output else contextlib.nullcontext():
        summary = controller.run()
    if json_output:
        print(json.dumps({"study": fingerprint.study_name, **summary.to_dict()}, indent=2,
                         default=str))  # fmt: skip
    else:
        console.print(best_table(summary, capacity))
        console.print(f"stopped: {summary.stop_reason}; {summary.probes} probes this run")
        best = summary.best
        if best is None:
            console.print("[red]no configuration fits[/]")
        else:
            console.print(
                f"[bold]best: {best.config.label()} at micro-batch {best.micro_batch_size} "
                f"(accumulation {best.attrs.get('grad_accum')}): {speed_text(best)}[/]"
            )
    if summary.interrupted:
        raise typer.Exit(143 if summary.interrupted == "SIGTERM" else 130)
    raise typer.Exit(0 if summary.best else 1)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's time limit, ``kill``) stops the run like Ctrl-C: the running
    probe is stopped and recorded, and the best so far printed."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stores(storage: str, model: str | None, gpu: str | None) -> list[Any]:
    """The studies of a storage matching a model name and a GPU key (None: any)."""
    from autotune.study import TrialStore

    stores = TrialStore.existing(storage)
    if model:
        stores = [s for s in stores if s.fingerprint.model == model]
    if gpu:
        stores = [s for s in stores if s.fingerprint.gpu == gpu.lower()]
    return stores


def _measurement_row(measurement: Any) -> dict[str, Any]:
    attrs = measurement.attrs
    return {
        "number": measurement.number,
        "config": measurement.config.to_dict(),
        "label": measurement.config.label(),
        "micro_batch_size": measurement.micro_batch_size,
        "repeat": measurement.repeat,
        "repeats": attrs.get("repeats", 1),
        "grad_accum": attrs.get("grad_accum"),
        "state": measurement.state,
        "outcome": measurement.outcome,
        "feasible": measurement.feasible,
        "objective": measurement.value,
        "tokens_per_second": attrs.get("objective_tokens_per_second"),
        "mfu": attrs.get("objective_mfu"),
        "peak_bytes": attrs.get("peak_reserved_bytes") or attrs.get("peak_allocated_bytes"),
        "probe_dir": attrs.get("probe_dir"),
        "message": attrs.get("message"),
    }


@app.command()
def best(
    model: Annotated[str | None, typer.Option(help="Only studies of this model.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Only studies on this GPU key.")] = None,
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL.")
    ] = "sqlite:///trials/autotune.db",
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The best configuration found so far, per study (workload x hardware x software)."""
    import optuna

    from autotune.report.live import pooled_note

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stores = _stores(storage, model, gpu)
    if not stores:
        raise UsageError(f"no autotune study in {storage} matches: run autotune run first")
    results = []
    for store in stores:
        found = store.best()
        results.append(
            {
                "study": store.fingerprint.study_name,
                "fingerprint": store.fingerprint.to_dict(),
                "trials": len(store.measurements()),
                "best": _measurement_row(found) if found else None,
            }
        )
    if json_output:
        print(json.dumps(results, indent=2, default=str))
    else:
        table = Table(
            "study", "configuration", "mbs", "accum", "tokens/s", "MFU", "peak", "trials",
            header_style="bold",
        )  # fmt: skip
        for entry in results:
            row = entry["best"] or {}
            table.add_row(
                entry["study"],
                row.get("label", "[red]nothing fits yet[/]"),
                str(row.get("micro_batch_size", "-")),
                str(row.get("grad_accum", "-")),
                _fmt(row.get("tokens_per_second"), ",.0f") + pooled_note(row.get("repeats", 1)),
                _fmt(row.get("mfu"), ".1%"),
                format_bytes(row["peak_bytes"]) if row.get("peak_bytes") else "-",
                str(entry["trials"]),
            )
        console.print(table)
    raise typer.Exit(0 if any(entry["best"] for entry in results) else 1)


@app.command()
def trials(
    model: Annotated[str | None, typer.Option(help="Only studies of this model.")] = None,
    gpu: Annotated[str | None, typer.Option(help="Only studies on this GPU key.")] = None,
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL.")
    ] = "sqlite:///trials/autotune.db",
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Every probe of every matching study: configuration, size, outcome, speed, memory."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stores = _stores(storage, model, gpu)
    if not stores:
        raise UsageError(f"no autotune study in {storage} matches: run autotune run first")
    data = [
        {
            "study": store.fingerprint.study_name,
            "trials": [_measurement_row(m) for m in store.measurements()],
        }
        for store in stores
    ]
    if json_output:
        print(json.dumps(data, indent=2, default=str))
        return
    for entry in data:
        table = Table(
            "#", "configuration", "mbs", "outcome", "tokens/s", "MFU", "peak", "probe folder",
            header_style="bold", title=entry["study"],
        )  # fmt: skip
        for row in entry["trials"]:
            outcome = row["outcome"] or row["state"].lower()
            if row["state"] == "COMPLETE" and not row["feasible"]:
                outcome = f"[red]{outcome}[/]"
            if row["repeat"]:
                outcome += f" (re-measure {row['repeat']})"
            table.add_row(
                str(row["number"]),
                row["label"],
                str(row["micro_batch_size"]),
                outcome,
                _fmt(row["tokens_per_second"], ",.0f"),
                _fmt(row["mfu"], ".1%"),
                format_bytes(row["peak_bytes"]) if row["peak_bytes"] else "-",
                row["probe_dir"] or "-",
            )
        console.print(table)


@app.command()
def models(
    json_output: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List the model presets with their parameter counts."""
    from autotune.models import preset_names, resolve_model

    rows: list[dict[str, Any]] = []
    for name in preset_names():
        spec = resolve_model(name)
        rows.append(
            {
                "name": name,
                "params": spec.num_params,
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "heads": spec.num_attention_heads,
                "kv_heads": spec.num_key_value_heads,
                "vocab": spec.vocab_size,
                "flops_per_token_2k": spec.flops_per_token(2048),
            }
        )
    if json_output:
        print(json.dumps(rows, indent=2))
        return
    table = Table(
        "model",
        "params",
        "layers",
        "hidden",
        "heads",
        "kv heads",
        "vocab",
        "GFLOP/token @2k",
        header_style="bold",
    )
    for row in rows:
        table.add_row(
            row["name"],
            _count(row["params"]),
            str(row["layers"]),
            str(row["hidden"]),
            str(row["heads"]),
            str(row["kv_heads"]),
            str(row["vocab"]),
            f"{row['flops_per_token_2k'] / 1e9:.2f}",
        )
    console.print(table)


def main() -> None:
    """Console entry point: one-line errors for bad input, never a traceback."""
    try:
        # Without standalone mode click returns a command's exit code instead of exiting.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except (UsageError, ConfigError, ValueError) as error:
        errors.print(f"[red]error:[/] {error}")
        sys.exit(2)
    except (typer.BadParameter, typer.Abort) as error:
        errors.print(f"[red]error:[/] {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/]")
        sys.exit(130)
    except Exception as error:  # click's own usage errors
        import click

        if isinstance(error, click.ClickException):
            error.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()

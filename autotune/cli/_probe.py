"""``autotune probe``: one configuration, run for real."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from autotune.cli._app import (
    UsageError,
    console,
    errors,
    parse_sizes,
    print_json,
    rlhf_options,
    script_options,
)
from autotune.cli.options import (
    AccumFlagOption,
    BatchFlagOption,
    CheckpointingFlagOption,
    CriticOption,
    FrameworkOption,
    FrozenOption,
    HostsOption,
    NodesOption,
    ReferenceOption,
    RewardOption,
    RlhfOption,
    RolloutShareOption,
    ScriptArgs,
    ScriptOption,
    SeqLenOption,
    SleepOption,
)
from autotune.config import (
    Attention,
    Engine,
    Loss,
    Offload,
    Optimizer,
    Precision,
    Schedule,
    TrainConfig,
    parse_ac_ops,
)
from autotune.units import format_duration

if TYPE_CHECKING:
    from rich.console import Console

    from autotune.devices.base import SetupResult, SetupStep


def probe(
    model: Annotated[
        str | None,
        typer.Option(help="Preset name or path to a config.json (default: tiny)."),
    ] = None,
    engine: Annotated[Engine, typer.Option(help="Training engine.")] = Engine.SINGLE,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage (fsdp: 2 or 3).")] = 0,
    precision: Annotated[Precision, typer.Option()] = Precision.BF16_MIXED,
    offload: Annotated[Offload, typer.Option(help="Model states kept on the CPU.")] = Offload.NONE,
    ac: Annotated[
        str,
        typer.Option(
            help="Activation checkpointing: off, every, every-N (whole blocks), ops (op-level "
            "in every block: matmul outputs kept, the rest recomputed), every-N+ops."
        ),
    ] = "off",
    attention: Annotated[Attention, typer.Option()] = Attention.SDPA,
    loss: Annotated[
        Loss,
        typer.Option(
            help="full: the model's own; chunked: the logits a chunk at a time; fused: "
            "Liger-Kernel's fused linear cross-entropy (a CUDA GPU)."
        ),
    ] = Loss.FULL,
    optimizer: Annotated[
        Optimizer,
        typer.Option(
            help="adamw: torch's fused AdamW; adamw-8bit: torchao's AdamW8bit (8-bit moments)."
        ),
    ] = Optimizer.ADAMW,
    lora_rank: Annotated[
        int,
        typer.Option(
            help="0: train every weight; r: LoRA, rank-r adapters on every linear layer of the "
            "blocks and the rest frozen (needs peft)."
        ),
    ] = 0,
    act_offload: Annotated[
        bool,
        typer.Option(
            "--act-offload",
            help="Keep what the decoder blocks save for the backward in pinned host memory "
            "(emulated on the CPU): a checkpointed block's input, every other block's "
            "activations.",
        ),
    ] = False,
    torch_compile: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Compile each decoder block with torch.compile (inductor on a GPU; on the CPU "
            "the partitioned graphs run op by op, so their memory is counted).",
        ),
    ] = False,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            help="Tensor-parallel degree: each block split over this many ranks of --gpus, "
            "with sequence parallelism (torch's DTensor plans); the rest data-parallel.",
        ),
    ] = 1,
    pp: Annotated[
        int,
        typer.Option(
            "--pp",
            help="Pipeline stages, one a rank of --gpus (torch's pipelining); the step's "
            "micro-steps (--grad-accum) are its microbatches.",
        ),
    ] = 1,
    pp_schedule: Annotated[
        Schedule, typer.Option("--pp-schedule", help="The pipeline's schedule.")
    ] = Schedule.ONE_F_ONE_B,
    pp_virtual: Annotated[
        int,
        typer.Option("--pp-virtual", help="Chunks a rank under --pp-schedule interleaved-1f1b."),
    ] = 1,
    micro_batch: Annotated[str, typer.Option(help="Size, or sizes to sweep: 1,2,4.")] = "1",
    seq_len: SeqLenOption = None,
    grad_accum: Annotated[int, typer.Option(help="Micro-steps per optimizer step.")] = 1,
    gpus: Annotated[int | None, typer.Option(help="Ranks (default: all GPUs, or 1).")] = None,
    nodes: NodesOption = None,
    hosts: HostsOption = None,
    device: Annotated[str, typer.Option(help="cuda, cpu or auto.")] = "auto",
    device_memory: Annotated[
        str | None, typer.Option(help="Emulated device-memory cap per rank, e.g. 20GiB.")
    ] = None,
    warmup_steps: Annotated[int, typer.Option()] = 2,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps.")] = 3,
    timeout: Annotated[str, typer.Option(help="Wall-clock limit, e.g. 10m.")] = "10m",
    trials_dir: Annotated[Path, typer.Option(help="Where probe folders go.")] = Path("trials"),
    study: Annotated[str, typer.Option(help="Folder name under trials-dir.")] = "probes",
    host_memory: Annotated[
        str | None,
        typer.Option(
            help="Host memory of the node for the job, e.g. 125GiB (default: what this node "
            "gives it); a probe predicted to need more is refused before it starts."
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
    json_output: Annotated[bool, typer.Option("--json", help="Print result.json.")] = False,
) -> None:
    """Run a few real training steps of one configuration and report OOM or throughput.

    With --script, the steps are your own training script's. With --rlhf, each step is an RL
    iteration: the rollout engine's share held (an emulated reservation), the models'
    scoring forwards, the policy's and critic's training steps."""
    from autotune import api
    from autotune.report.tables import probe_report

    given = dict(locals())  # the options by parameter name: nothing else is bound yet
    ac_every, ac_ops = parse_ac_ops(ac)
    chosen = {name: given[name] for name in _CONFIG_FIELDS}
    config = TrainConfig(**chosen, ac_every=ac_every, ac_ops=ac_ops)
    sizes = parse_sizes(micro_batch)
    job = script_options(given)
    if not job and model is None:
        model = "tiny"
    roles = {"reference": reference, "critic": critic, "reward": reward}
    iteration = _rlhf_probe(rlhf, model, rollout_share, sleep, frozen, **roles)
    # With --json, stdout is result.json alone.
    progress = _Progress(errors if json_output else console, device, micro_batch)
    with progress.running:
        result = api.probe(
            model,
            config,
            **job,
            **{name: given[name] for name in _PASSED},
            micro_batch_sizes=sizes,
            timed_steps=steps,
            folder=study,
            on_start=progress.started,
            set_up=progress.set_up,
            rlhf=iteration,
        )
    if json_output:
        print_json(result.to_dict())
    else:
        console.print(probe_report(result))
    raise typer.Exit(0 if result.ok_sizes() else 1)


_CONFIG_FIELDS = (
    "engine",
    "zero_stage",
    "precision",
    "offload",
    "attention",
    "loss",
    "optimizer",
    "lora_rank",
    "act_offload",
    "torch_compile",
    "tp",
    "pp",
    "pp_schedule",
    "pp_virtual",
)
"""``probe``'s options that are the configuration's own fields, under the same names."""

_PASSED = (
    "seq_len",
    "grad_accum",
    "gpus",
    "nodes",
    "hosts",
    "device",
    "device_memory",
    "warmup_steps",
    "host_memory",
    "timeout",
    "trials_dir",
)
"""``probe``'s options :func:`autotune.api.probe` takes under the same names."""


@dataclasses.dataclass
class _Progress:
    """A probe's lines on the terminal: where it runs, its set-up steps (each outside the
    probe's timeout) and a spinner while it runs."""

    shown: Console
    device: str
    micro_batch: str
    running: contextlib.ExitStack[None] = dataclasses.field(default_factory=contextlib.ExitStack)

    def started(self, spec: Any, probe_dir: Path) -> None:
        if self.device == "auto" and spec.device == "cpu":
            errors.print("[yellow]no GPU found: probing on the CPU (--device cuda to insist)[/]")
        timeout_text = format_duration(spec.timeout_s)
        self.shown.print(
            f"[dim]probing {spec.config.label()} at micro-batch {self.micro_batch} on "
            f"{spec.world_size} x {spec.device} (at most {timeout_text}) in {probe_dir} ...[/]"
        )
        where = f"probe running ({spec.world_size} x {spec.device})"
        self.running.enter_context(self.shown.status(where))

    def set_up(self, step: SetupStep) -> SetupResult:
        from autotune.report.live import print_setup_done

        line = f"set-up: {step.label} (its own step, outside the probe's timeout)"
        self.shown.print(line, style="dim", markup=False, highlight=False)
        with self.shown.status(step.label):
            done = step.run()
        print_setup_done(self.shown, done)
        return done


def _rlhf_probe(
    algorithm: str | None,
    model: str | None,
    share: str | None,
    sleep: bool | None,
    frozen: str | None,
    **roles: str | None,
) -> Any:
    """``probe --rlhf``'s iteration (an ``autotune.tuned.rlhf.RLHFProbe``), or None without it;
    one line for an RLHF option without ``--rlhf``."""
    from autotune.tuned.rlhf import Algorithm, RLHFProbe, parse_placements, parse_shares, role_names

    given = {"--rollout-share": share, "--sleep": sleep, "--frozen": frozen}
    rlhf_options(algorithm, ("probes", ""), given | {f"--{r}": v for r, v in roles.items()}, {})
    if algorithm is None:
        return None
    if share is None:
        raise UsageError("--rlhf needs --rollout-share: the engine's share to hold, e.g. 0.5")
    shares = parse_shares(share)
    if len(shares) != 1:
        raise UsageError(f"--rollout-share {share}: a probe holds one share, e.g. 0.5")
    if algorithm not in ("ppo", "grpo"):
        raise UsageError(f"--rlhf {algorithm!r}: use ppo or grpo")
    places = parse_placements(frozen or "gpu")
    if len(places) != 1:
        raise UsageError(f"--frozen {frozen}: a probe keeps them in one place, gpu or host")

    models = role_names(Algorithm(algorithm), model or "tiny", **roles)
    return RLHFProbe(
        algorithm=Algorithm(algorithm),
        reference=models["reference"],
        critic=models["critic"],
        reward=models["reward"],
        share=shares[0],
        sleep=bool(sleep),
        frozen=places[0],
    )

"""The ``autotune`` command line.

Every command that prints results also takes ``--json``. Bad input ends with one line that
says what to do, and exit code 2; `autotune probe` exits 0 when at least one micro-batch
size fits, 1 when none does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.core
from rich.console import Console

from autotune.config import (
    LORA_RANK,
    Attention,
    ConfigError,
    Engine,
    Loss,
    LossDtype,
    NothingFits,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
    parse_ac_ops,
)
from autotune.script import Framework, ScriptJob
from autotune.study.fingerprint import DEFAULT_STORAGE
from autotune.study.urls import masked
from autotune.units import format_duration

if TYPE_CHECKING:
    from autotune import api
    from autotune.jobs import Freshness, Job, JobResult
    from autotune.search.controller import Event


def _plain_flags(params: list[Any]) -> list[Any]:
    """On/off options shown without a type: ``--json`` takes no value, so no ``<bool>``."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="OOM-driven auto-tuner for large-model training: finds the fastest configuration "
    "that fits your GPUs.",
)
command = functools.partial(app.command, cls=_Command)
"""Every command is a :class:`_Command` (its flags shown as flags)."""


def _version(value: bool) -> None:
    if not value:
        return
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    others = ", ".join(
        f"{n} {version(n)}" for n in ("torch", "deepspeed", "transformers", "optuna")
    )
    print(f"autotune {version('autotune')} ({others}; Python {sys.version.split()[0]})")
    raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the versions and exit."
        ),
    ] = False,
) -> None:
    """OOM-driven auto-tuner for large-model training: finds the fastest configuration that
    fits your GPUs."""


# Piped output is read by people too: do not squeeze tables into 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def _parse_sizes(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) >= 1 for part in parts):
        raise UsageError(
            f"invalid micro-batch {text!r}: use a positive integer or a list like 1,2,4"
        )
    return tuple(int(part) for part in parts)


# Options several commands share.
ModelOption = Annotated[str, typer.Option(help="Preset name or path to a config.json.")]
ScriptOption = Annotated[
    Path | None,
    typer.Option(
        help="Your own training script: each probe runs it with the configuration applied "
        "(its own arguments after --).",
        show_default=False,
    ),
]
FrameworkOption = Annotated[
    str | None,
    typer.Option(
        help="What the script is written for: hf (a Trainer script: its flags are rewritten), "
        "accelerate (accelerate launch with a generated config) or torchrun (it reads "
        "autotune.job_config()).",
        show_default=False,
    ),
]
BatchFlagOption = Annotated[
    str | None,
    typer.Option(
        help="The script's own flag for the per-GPU micro-batch, e.g. --batch-size "
        "(accelerate and torchrun scripts; found by its name in the script's argparse unless "
        "the script reads autotune.job_config(); none: it has none).",
        show_default=False,
    ),
]
AccumFlagOption = Annotated[
    str | None,
    typer.Option(
        help="The script's own flag for micro-steps per optimizer step, e.g. --grad-accum "
        "(found as --batch-flag is; none: it has none).",
        show_default=False,
    ),
]
CheckpointingFlagOption = Annotated[
    str | None,
    typer.Option(
        help="The script's own switch that checkpoints every decoder block, e.g. "
        "--activation-checkpointing (given or left out; every k-th block is then not tried; "
        "found as --batch-flag is; none: it has none).",
        show_default=False,
    ),
]
ScriptArgs = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="[-- SCRIPT_ARGS...]", help="The script's own arguments.", show_default=False
    ),
]
StorageOption = Annotated[
    str,
    typer.Option(
        envvar="AUTOTUNE_STORAGE",
        help="Optuna storage URL (or $AUTOTUNE_STORAGE: a password there stays out of ps).",
    ),
]
NodesOption = Annotated[
    int | None,
    typer.Option(
        help="Nodes a probe spans (default: all of the Slurm allocation autotune runs in, "
        "else 1); --gpus is then the GPUs in all.",
        show_default=False,
    ),
]
HostsOption = Annotated[
    str | None,
    typer.Option(
        help="The nodes, this host first: this-host,node2 (others reached by ssh; "
        "inside Slurm, leave it out).",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
FilterModel = Annotated[str | None, typer.Option(help="Only studies of this model.")]
FilterGpu = Annotated[str | None, typer.Option(help="Only studies on this GPU key.")]
FilterStudy = Annotated[
    str | None, typer.Option(help="The study's name, where several match (see best).")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Overwrite the -o file.")]
RlhfOption = Annotated[
    str | None,
    typer.Option(
        help="An RL iteration, ppo or grpo: --model is the policy, beside its reference, "
        "critic and reward models and a rollout engine on the same GPUs.",
        rich_help_panel="RLHF",
    ),
]
RolloutShareOption = Annotated[
    str | None,
    typer.Option(
        help="The rollout engine's share of each GPU (vLLM's gpu_memory_utilization): 0.5 or "
        "50%; plan: a list too, 0.4,0.6 (default: 0.3 to 0.9).",
        rich_help_panel="RLHF",
    ),
]
SleepOption = Annotated[
    bool | None,
    typer.Option(
        "--sleep/--no-sleep",
        help="The engine sleeps while the models score and train (plan: both tried unless given).",
        rich_help_panel="RLHF",
    ),
]
ReferenceOption = Annotated[
    str | None,
    typer.Option(
        help="The reference model (default: the policy's shape; none).", rich_help_panel="RLHF"
    ),
]
CriticOption = Annotated[
    str | None,
    typer.Option(help="PPO's critic (default: the policy's shape).", rich_help_panel="RLHF"),
]
RewardOption = Annotated[
    str | None,
    typer.Option(
        help="The reward model (default: the policy's shape; none for a rule-based reward).",
        rich_help_panel="RLHF",
    ),
]
RolloutBatchOption = Annotated[
    int | None,
    typer.Option(
        help="Sequences an iteration generates and trains on, all GPUs (default: 2 per GPU).",
        rich_help_panel="RLHF",
    ),
]
ResponseLenOption = Annotated[
    int | None,
    typer.Option(
        help="Tokens generated per sequence (default: half of --seq-len).",
        rich_help_panel="RLHF",
    ),
]
FrozenOption = Annotated[
    str | None,
    typer.Option(
        help="Where the frozen models wait: gpu, host (offloaded between uses); plan and run: "
        "gpu,host too (default: both; probe: gpu).",
        rich_help_panel="RLHF",
    ),
]
EngineOption = Annotated[
    str | None, typer.Option(help="Only these engines, comma-separated: fsdp,deepspeed.")
]
LossOption = Annotated[
    str | None,
    typer.Option(
        "--loss",
        help="Losses to try, comma-separated: full (the model's own), chunked (the logits a "
        "chunk at a time), fused (Liger-Kernel, on GPUs). Default: full and chunked (chunked "
        "where it pays).",
    ),
]
OptimizerOption = Annotated[
    str | None,
    typer.Option(
        "--optimizer",
        help="Optimizers to try, comma-separated: adamw (torch's fused AdamW), adamw-8bit "
        "(torchao's 8-bit moments; not with DeepSpeed or offload). Default: both (8-bit where "
        "it pays).",
    ),
]
AllowOption = Annotated[
    str | None,
    typer.Option(
        "--allow",
        help="Trainings other than full fine-tuning to plan too: lora (peft's adapters on every "
        "linear layer of the blocks, the rest frozen), ranked after the full fine-tuning that "
        "fits.",
    ),
]
ActOffloadOption = Annotated[
    bool,
    typer.Option(
        "--act-offload/--no-act-offload",
        help="Try activation offload (act:host: the blocks' saved tensors in pinned host "
        "memory) where it fits a larger micro-batch.",
    ),
]
AcOpsOption = Annotated[
    bool,
    typer.Option(
        "--ac-ops/--no-ac-ops",
        help="Try op-level selective checkpointing (ac:ops) where it fits a larger micro-batch.",
    ),
]
SeqLenOption = Annotated[
    int | None,
    typer.Option(help="Tokens per sequence (default: 2048, or the model's positions if fewer)."),
]
GlobalBatchOption = Annotated[
    int | None, typer.Option(help="Sequences per optimizer step (default: 8 per GPU).")
]
HeadroomOption = Annotated[str, typer.Option(help="Memory to leave free, e.g. 10%.")]
HostCoresOption = Annotated[
    int | None,
    typer.Option(
        help="CPU cores of a node, which host Adam under offload runs on (default: this "
        "node's; with --simulate: 16 per GPU).",
    ),
]
HostMemoryOption = Annotated[
    str | None,
    typer.Option(
        help="Host memory of a node for the job, e.g. 125GiB (default: what this node gives "
        "it; with --simulate: not limited)."
    ),
]
PlanHostCores = Annotated[
    int | None,
    typer.Option(
        "--host-cores",
        help="CPU cores of a node, which host Adam under offload runs on (default: this "
        "node's for its own GPU, else 16 per GPU).",
    ),
]
PlanHostMemory = Annotated[
    str | None,
    typer.Option(
        "--host-memory",
        help="Host memory of a node for the job, e.g. 125GiB (default: what this node gives "
        "it, for its own GPU; for another GPU: not checked).",
    ),
]


def _quiet_optuna() -> None:
    """Optuna's INFO lines (a study created or reused) would mix with the tables."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


@command()
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
    from autotune.devices.base import SetupResult, SetupStep
    from autotune.report.live import print_setup_done
    from autotune.report.tables import probe_report

    ac_every, ac_ops = parse_ac_ops(ac)
    config = TrainConfig(
        engine=engine,
        zero_stage=zero_stage,
        precision=precision,
        offload=offload,
        ac_every=ac_every,
        ac_ops=ac_ops,
        attention=attention,
        loss=loss,
        optimizer=optimizer,
        lora_rank=lora_rank,
        act_offload=act_offload,
        torch_compile=torch_compile,
    )
    sizes = _parse_sizes(micro_batch)
    running = contextlib.ExitStack()

    shown = errors if json_output else console  # with --json, stdout is result.json alone

    def started(spec: Any, probe_dir: Path) -> None:
        if device == "auto" and spec.device == "cpu":
            errors.print("[yellow]no GPU found: probing on the CPU (--device cuda to insist)[/]")
        timeout_text = format_duration(spec.timeout_s)
        shown.print(
            f"[dim]probing {spec.config.label()} at micro-batch {micro_batch} on "
            f"{spec.world_size} x {spec.device} (at most {timeout_text}) in {probe_dir} ...[/]"
        )
        running.enter_context(shown.status(f"probe running ({spec.world_size} x {spec.device})"))

    def set_up(step: SetupStep) -> SetupResult:
        line = f"set-up: {step.label} (its own step, outside the probe's timeout)"
        shown.print(line, style="dim", markup=False, highlight=False)
        with shown.status(step.label):
            done = step.run()
        print_setup_done(shown, done)
        return done

    job: dict[str, Any] = {}
    flags = {
        "batch_flag": batch_flag,
        "accum_flag": accum_flag,
        "checkpointing_flag": checkpointing_flag,
    }
    if script is not None or framework is not None or script_args or any(flags.values()):
        job = {
            "script": script,
            "framework": framework,
            "script_args": script_args or (),
            **flags,
        }
    elif model is None:
        model = "tiny"
    iteration = _rlhf_probe(
        rlhf,
        model,
        rollout_share,
        sleep,
        frozen,
        reference=reference,
        critic=critic,
        reward=reward,
    )
    with running:
        result = api.probe(
            model,
            config,
            **job,
            micro_batch_sizes=sizes,
            seq_len=seq_len,
            grad_accum=grad_accum,
            gpus=gpus,
            nodes=nodes,
            hosts=hosts,
            device=device,
            device_memory=device_memory,
            warmup_steps=warmup_steps,
            timed_steps=steps,
            host_memory=host_memory,
            timeout=timeout,
            trials_dir=trials_dir,
            folder=study,
            on_start=started,
            set_up=set_up,
            rlhf=iteration,
        )
    if json_output:
        _print_json(result.to_dict())
    else:
        console.print(probe_report(result))
    raise typer.Exit(0 if result.ok_sizes() else 1)


def _rlhf_options(
    rlhf: str | None,
    verbs: tuple[str, str],
    options: Mapping[str, object],
    others: Mapping[str, object],
    why: str = "",
) -> dict[str, Any]:
    """The RLHF ``options`` as keyword arguments, once checked: one line for one given
    without ``--rlhf`` (``--frozen plans an RL iteration: ...``), or, with it, for one of the
    ``others`` it does not take (``--loss is not planned with --rlhf: leave it out``).
    ``verbs``: what the command does with an iteration, and its past participle."""
    if rlhf is None:
        named = [name for name, value in options.items() if value is not None]
        if named:
            raise UsageError(
                f"{named[0]} {verbs[0]} an RL iteration: add --rlhf ppo or --rlhf grpo"
            )
    else:
        named = [name for name, value in others.items() if value is not None]
        if named:
            what = "use --rollout-batch" if named[0] == "--global-batch" else "leave it out"
            raise UsageError(f"{named[0]} is not {verbs[1]} with --rlhf{why}: {what}")
    return {name.lstrip("-").replace("-", "_"): value for name, value in options.items()}


def _rlhf_probe(
    algorithm: str | None,
    model: str | None,
    share: str | None,
    sleep: bool | None,
    frozen: str | None,
    **roles: str | None,
) -> Any:
    """``probe --rlhf``'s iteration (an ``autotune.rlhf.RLHFProbe``), or None without it;
    one line for an RLHF option without ``--rlhf``."""
    from autotune.rlhf import Algorithm, RLHFProbe, parse_placements, parse_shares, role_names

    given = {"--rollout-share": share, "--sleep": sleep, "--frozen": frozen}
    _rlhf_options(algorithm, ("probes", ""), given | {f"--{r}": v for r, v in roles.items()}, {})
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


ALLOWED = ("lora",)
"""What ``--allow`` takes: trainings other than full fine-tuning."""


def _allowed(text: str | None) -> bool:
    """Whether ``--allow`` names LoRA; anything else it names is a usage error."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    unknown = [name for name in names if name not in ALLOWED]
    if unknown:
        raise ConfigError(f"--allow {unknown[0]}: use --allow {' or '.join(ALLOWED)}")
    return "lora" in names


def _parse_engines(text: str | None) -> list[Engine] | None:
    if text is None:
        return None
    choices = ", ".join(e.value for e in Engine)
    try:
        return [Engine(part.strip()) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"unknown engine in {text!r}: use {choices}, comma-separated") from None


@command()
def plan(
    model: ModelOption = "llama-7b",
    gpu: Annotated[
        str | None, typer.Option(help="GPU key (h100-80gb, a100-40gb, ...) or a .toml file.")
    ] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs in all (default: those here).")] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs sharing a node.")] = 8,
    seq_len: SeqLenOption = None,
    global_batch: GlobalBatchOption = None,
    engine: EngineOption = None,
    precision: Annotated[
        Precision | None, typer.Option(help="Default: bf16-mixed, fp16-mixed without bf16.")
    ] = None,
    attention: Annotated[Attention, typer.Option()] = Attention.SDPA,
    loss: LossOption = None,
    ac_ops: AcOpsOption = True,
    act_offload: ActOffloadOption = True,
    optimizer: OptimizerOption = None,
    allow: AllowOption = None,
    lora_rank: Annotated[int, typer.Option(help="LoRA's rank with --allow lora.")] = LORA_RANK,
    headroom: HeadroomOption = "0%",
    reserve: Annotated[
        str | None,
        typer.Option(
            help="Device memory kept for the CUDA context and libraries (default 1.25GiB, as "
            "measured on an H100)."
        ),
    ] = None,
    host_memory: PlanHostMemory = None,
    host_cores: PlanHostCores = None,
    offload: Annotated[
        bool | None,
        typer.Option(
            "--offload/--no-offload",
            help="Try the trainer's CPU offload rungs (default: yes; with --rlhf: no).",
        ),
    ] = None,
    loss_dtype: Annotated[
        LossDtype | None,
        typer.Option(
            help="The dtype your job's loss takes the logits in: fp32 (the model's own loss, "
            "as autotune's exports train; the default) or logits (their own: F.cross_entropy "
            "of bf16 logits in pure bf16). run --script measures it.",
        ),
    ] = None,
    rlhf: RlhfOption = None,
    rollout_share: RolloutShareOption = None,
    sleep: SleepOption = None,
    frozen: FrozenOption = None,
    reference: ReferenceOption = None,
    critic: CriticOption = None,
    reward: RewardOption = None,
    rollout_batch: RolloutBatchOption = None,
    response_len: ResponseLenOption = None,
    top: Annotated[int, typer.Option(help="Rows to show (0: all).")] = 15,
    json_output: JsonOption = False,
) -> None:
    """Rank every configuration by predicted throughput, with predicted peak memory (no GPU).
    With --rlhf: every layout of an RL iteration, by predicted samples per second."""
    from autotune import api
    from autotune.report.tables import plan_table

    if top < 0:
        raise UsageError(f"--top {top}: use a number of rows, or 0 for all")
    rl_options = _rlhf_options(
        rlhf,
        ("plans", "planned"),
        {
            "--rollout-share": rollout_share,
            "--sleep": sleep,
            "--frozen": frozen,
            "--reference": reference,
            "--critic": critic,
            "--reward": reward,
            "--rollout-batch": rollout_batch,
            "--response-len": response_len,
        },
        {
            "--global-batch": global_batch,
            "--loss": loss,
            "--optimizer": optimizer,
            "--allow": allow,
            "--loss-dtype": loss_dtype,
        },
        why=" (its trainer climbs the ladder's rungs alone)",
    )
    if rlhf is not None:
        _plan_rlhf(
            rlhf,
            model,
            gpu=gpu,
            gpus=gpus,
            gpus_per_node=gpus_per_node,
            seq_len=seq_len,
            engine=engine,
            precision=precision,
            offload=offload,
            reserve=reserve,
            top=top,
            json_output=json_output,
            **rl_options,
        )
        return
    found = api.plan(
        model,
        gpu=gpu,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        seq_len=seq_len,
        global_batch=global_batch,
        engines=_parse_engines(engine),
        precision=precision,
        attention=attention,
        headroom=headroom,
        host_memory=host_memory,
        host_cores=host_cores,
        reserve=api.DEVICE_RESERVE_BYTES if reserve is None else reserve,
        losses=loss,
        op_checkpointing=ac_ops,
        optimizers=optimizer,
        lora_rank=lora_rank if _allowed(allow) else None,
        activation_offload=act_offload,
        offload=True if offload is None else offload,
        loss_dtype=loss_dtype or LossDtype.FP32,
    )
    if json_output:
        _print_json(found.to_dict())
        return
    w = found.workload
    own = ", the loss in the logits' dtype" if w.loss_dtype is LossDtype.LOGITS else ""
    title = (
        f"{found.model.name} on {w.world_size} x {found.gpu.name}, seq {w.seq_len}, global "
        f"batch {w.global_batch}{own}: predicted, not measured"
    )
    console.print(found.host.text(), style="dim", markup=False, highlight=False)
    console.print(plan_table(found.rows, title=title, top=top, seconds=found.seconds))


def _plan_rlhf(
    algorithm: str,
    model: str,
    *,
    engine: str | None,
    reserve: str | None,
    offload: bool | None,
    top: int,
    json_output: bool,
    **options: Any,
) -> None:
    """``autotune plan --rlhf``: the RL iteration's layouts, as a table or JSON."""
    from autotune import api
    from autotune.report.tables import rlhf_plan_table

    found = api.plan_rlhf(
        algorithm,
        model,
        engines=_parse_engines(engine),
        reserve=api.DEVICE_RESERVE_BYTES if reserve is None else reserve,
        offload=bool(offload),
        **options,
    )
    if json_output:
        _print_json(found.to_dict())
        return
    w = found.workload
    roles = ", ".join(f"{role} {m.name}" for role, m in [*w.models.trained(), *w.models.frozen()])
    title = (
        f"{w.algorithm.value.upper()} on {w.world_size} x {found.gpu.name} ({roles}), seq "
        f"{w.seq_len} ({w.response_len} generated), rollout batch {w.rollout_batch}: "
        "predicted, not measured"
    )
    console.print(rlhf_plan_table(found.rows, title=title, top=top, seconds=found.seconds))


def _run_rlhf(algorithm: str, model: str, *, json_output: bool, **options: Any) -> None:
    """``autotune run --rlhf``: probe layouts of an RL iteration, a line a probe, then the
    best (or the summary as JSON)."""
    from autotune import api
    from autotune.rlhf import Placement

    _quiet_optuna()
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
        _print_json(summary.to_dict())
        return
    count = f"{summary.probes} probe{'' if summary.probes == 1 else 's'}"
    console.print(f"stopped: {summary.stop_reason}; {count} this run; study {summary.study}")
    best = summary.best
    if best is None:
        console.print("[red]no layout fitted: lower --rollout-share, or let --sleep[/]")
        raise typer.Exit(1)
    console.print(
        f"best: {best.config.label()}, rollout share {best.share:.0%}"
        f"{', engine asleep while training' if best.sleep else ''}, micro-batch "
        f"{best.micro_batch_size}: {best.samples_per_second:,.2f} samples/s (rollout "
        "predicted: the engine is emulated)"
    )


@command()
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
    from autotune import api

    rl_options = _rlhf_options(
        rlhf,
        ("tunes", "tuned"),
        {
            "--rollout-share": rollout_share,
            "--sleep": sleep,
            "--frozen": frozen,
            "--reference": reference,
            "--critic": critic,
            "--reward": reward,
            "--rollout-batch": rollout_batch,
            "--response-len": response_len,
        },
        {
            "--jobs": jobs,
            "--script": script,
            "--simulate": simulate,
            "--global-batch": global_batch,
            "--loss": loss,
            "--optimizer": optimizer,
            "--allow": allow,
            "--nodes": nodes,
            "--hosts": hosts,
        },
    )
    if rlhf is not None:
        _run_rlhf(
            rlhf,
            model or "llama-7b",
            device=device,
            device_memory=device_memory,
            gpus=gpus,
            seq_len=seq_len,
            engines=_parse_engines(engine),
            precision=precision,
            budget=budget,
            storage=storage,
            trials_dir=trials_dir,
            json_output=json_output,
            **rl_options,
        )
        return
    from autotune.report.live import RunView, speed_text
    from autotune.report.tables import ranking_table, ranks_text
    from autotune.study.measurement import prediction_gap

    _quiet_optuna()
    # The run's options, as a job file names them (a workload's own fields override them).
    options: dict[str, Any] = {
        "budget": budget,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "gpus": gpus,
        "nodes": nodes,
        "hosts": hosts,
        "engine": engine,
        "precision": precision,
        "attention": attention,
        "loss": loss,
        "ac_ops": True if ac_ops else None,  # a job file's workload may set it
        "act_offload": True if act_offload else None,
        "optimizer": optimizer,
        "lora_rank": lora_rank if _allowed(allow) else None,
        "simulate": simulate,
        "device": device,
        "device_memory": device_memory,
        "headroom": headroom,
        "host_memory": host_memory,
        "host_cores": host_cores,
        "objective": objective,
        "storage": storage,
        "trials_dir": str(trials_dir),
        "seed": seed,
        "warm": warm,
    }
    if jobs is not None:
        if model is not None:
            raise UsageError("--model and --jobs: name each workload's model in the job file")
        own_flags = batch_flag or accum_flag or checkpointing_flag
        if script is not None or framework is not None or script_args or own_flags:
            raise UsageError("--script and --jobs: name each workload's script in the job file")
        _run_jobs(jobs, max_age=max_age, json_output=json_output, **options)
    if max_age is not None:
        raise UsageError("--max-age applies to --jobs: a single run always tunes")
    options["engines"] = _parse_engines(options.pop("engine"))
    options["losses"] = options.pop("loss")
    options["op_checkpointing"] = options.pop("ac_ops") is True
    options["activation_offload"] = options.pop("act_offload") is True
    options["optimizers"] = options.pop("optimizer")
    flags = {
        "batch_flag": batch_flag,
        "accum_flag": accum_flag,
        "checkpointing_flag": checkpointing_flag,
    }
    if script is not None or framework is not None or script_args or any(flags.values()):
        options.update(script=script, framework=framework, script_args=script_args or (), **flags)
    elif model is None:
        model = "llama-7b"
    tuning = api.prepare(model, **options)
    simulated = tuning.device.kind == "simulated"
    w = tuning.workload
    # With --json, stdout is the summary alone: the progress goes to stderr.
    shown = errors if json_output else console
    job = tuning.template.script
    how = "" if job is None else f"; probes run {job.name} ({_job_ranks(job, warm)}{_own(job)})"
    shown.print(
        f"tuning {tuning.model.name} on {ranks_text(tuning.template)} x {tuning.gpu.name}"
        f"{' (simulated)' if simulated else ''}, seq {w.seq_len}, global batch "
        f"{w.global_batch}{how}; study [bold]{tuning.fingerprint.study_name}[/] in "
        f"{masked(storage)}",
        markup=True,
    )
    view = RunView(
        shown,
        budget_s=tuning.budget_s,
        simulated=simulated,
        objective=tuning.fingerprint.objective,
        job=job is not None,
    )
    with _sigterm_interrupts(), view:
        summary = tuning.run(view)
    gap = None
    if job is not None:
        gap = prediction_gap(summary.measurements)
    if json_output:
        extra = {} if gap is None else {"prediction_gap": gap.to_dict()}
        _print_json({"study": tuning.fingerprint.study_name, **summary.to_dict(), **extra})
    elif summary.mistake:
        pass  # one line, below: the job's own mistake is bad input
    else:
        if summary.best is not None:  # an empty table says nothing
            console.print(ranking_table(summary.measurements, tuning.capacity_bytes))
        count = f"{summary.probes} probe{'' if summary.probes == 1 else 's'}"
        console.print(f"stopped: {summary.stop_reason}; {count} this run")
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
    if summary.interrupted:
        raise typer.Exit(143 if summary.interrupted == "SIGTERM" else 130)
    if summary.mistake:
        raise ConfigError(summary.stop_reason)
    raise typer.Exit(0 if summary.best and not summary.failure else 1)


def _own(job: ScriptJob) -> str:
    """The script's own flags autotune sets, for the run's first line."""
    flags = (
        (job.batch_flag, "micro-batch"),
        (job.accum_flag, "accumulation"),
        (job.checkpointing_flag, "checkpointing"),
    )
    named = [f"{flag} ({knob})" for flag, knob in flags if flag]
    return f"; its own flags {', '.join(named)}" if named else ""


def _job_ranks(job: ScriptJob, warm: bool) -> str:
    """How a job's ranks start, for the run's first line."""
    if job.framework is Framework.ACCELERATE:
        return "accelerate launch starts its ranks, each a fresh interpreter"
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

    with _sigterm_interrupts():
        results = api.tune_jobs(path, max_age=max_age, on_job=started, on_result=ended, **defaults)
    if json_output:
        _print_json(
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


@command()
def best(
    model: FilterModel = None,
    gpu: FilterGpu = None,
    storage: StorageOption = DEFAULT_STORAGE,
    json_output: JsonOption = False,
) -> None:
    """The best configuration found so far, per study (workload x hardware x software)."""
    from autotune import api
    from autotune.report.tables import best_table

    studies = api.best(model=model, gpu=gpu, storage=storage, last=0)
    if json_output:
        _print_json(
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


TRIALS_SHOWN = 50
"""Trials per study ``autotune trials`` shows as a table unless asked for more: a study of
10,000 trials takes seconds to lay out in full."""


@command()
def trials(
    model: FilterModel = None,
    gpu: FilterGpu = None,
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
    studies = api.trials(model=model, gpu=gpu, storage=storage, last=last, best=False)
    shown = {s.study_name: sorted(s.measurements, key=lambda m: m.number) for s in studies}
    if json_output:
        _print_json(
            [
                {"study": s.study_name, "trials": [m.to_dict() for m in shown[s.study_name]]}
                for s in studies
            ]
        )
        return
    for s in studies:
        console.print(trials_table(s.study_name, shown[s.study_name], total=s.trial_count))


@command()
def export(
    format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="deepspeed, accelerate, hf, torchrun or fsdp; for a run --script study: "
            "command (your script's command line, tuned); for a run --rlhf study: trl, "
            "openrlhf or verl.",
            show_default=False,
        ),
    ],
    model: FilterModel = None,
    gpu: FilterGpu = None,
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

    DeepSpeed JSON, accelerate YAML, TrainingArguments, a torchrun line, FSDP2 code, your
    script's own command line (command), or an RL trainer's configuration (trl, openrlhf,
    verl)."""
    from autotune import api
    from autotune.launch import Format
    from autotune.rlhf_launch import RLFormat

    if format not in set(Format) | set(RLFormat):
        choices = ", ".join([*(f.value for f in Format), *(f.value for f in RLFormat)])
        raise UsageError(f"unknown export format {format!r}: use one of {choices}")
    if output is not None:
        api.check_output(output, force=force)
    if format in set(RLFormat):
        if trial is not None or engine is not None or gpu is not None:
            raise UsageError(
                f"--format {format} exports an RLHF study's best layout: leave out --trial, "
                "--engine and --gpu (name the study with --study or its policy with --model)"
            )
        _quiet_optuna()
        rl = api.export_rlhf(format, model=model, study=study, storage=storage)
        if output is not None:
            api.write_new_file(output, rl.text, force=force)
        if json_output:
            _print_json({**rl.to_dict(), "output": str(output) if output else None})
            return
        for note in rl.notes:
            errors.print(f"note: {note}", markup=False, highlight=False)
        if output is None:
            sys.stdout.write(rl.text)
        else:
            errors.print(
                f"wrote {output}: {format} for {rl.trial.config.label()}, rollout share "
                f"{rl.trial.share:.0%} (trial {rl.trial.number} of {rl.study})",
                markup=False,
                highlight=False,
            )
        return
    found = api.export(
        format, model=model, gpu=gpu, study=study, storage=storage, trial=trial, engine=engine
    )
    if output is not None:
        api.write_new_file(output, found.text, force=force)
    if not json_output:
        for note in found.notes:
            errors.print(f"note: {note}", markup=False, highlight=False)
    if json_output:
        _print_json({**found.to_dict(), "output": str(output) if output else None})
    elif output is None:
        sys.stdout.write(found.text)
    else:
        errors.print(
            f"wrote {output}: {found.format.value} for {found.launch.config.label()} at "
            f"micro-batch {found.launch.micro_batch_size} (trial {found.measurement.number} of "
            f"{found.study})",
            markup=False,
            highlight=False,
        )


@command()
def report(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The HTML file to write.", show_default=False)
    ],
    model: FilterModel = None,
    gpu: FilterGpu = None,
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
        output, model=model, gpu=gpu, study=study, storage=storage, budget=budget, force=force
    )
    if json_output:
        _print_json(done.to_dict())
    else:
        errors.print(f"wrote {done.path}: {done.study}", markup=False, highlight=False)


@command()
def models(json_output: JsonOption = False) -> None:
    """List the model presets with their parameter counts."""
    from autotune.models import preset_names, resolve_model
    from autotune.report.tables import models_table

    specs = [resolve_model(name) for name in preset_names()]
    if json_output:
        _print_json(
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


PRIVATE_UMASK = 0o027
"""Bits no file or folder the command creates grants: nothing for other users, no writing
for the group (probe folders, logs, the trial database, exports and reports; the ranks
inherit it). A stricter umask of the user's stays."""


def main() -> None:
    """Console entry point: one-line errors for bad input, never a traceback."""
    os.umask(os.umask(0) | PRIVATE_UMASK)
    if len(sys.argv) == 1:
        sys.argv.append("--help")  # bare ``autotune``: the help, exit 0
    try:
        # Without standalone mode click returns a command's exit code instead of exiting.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except (typer.BadParameter, typer.Abort) as error:
        # "Invalid value for '--last': ...": the message names the option.
        message = error.format_message() if isinstance(error, typer.BadParameter) else error
        errors.print(f"[red]error:[/] {message}")
        sys.exit(2)
    except NothingFits as error:
        errors.print(f"[red]error:[/] {error}")
        sys.exit(1)
    except (UsageError, ConfigError, ValueError) as error:
        errors.print(f"[red]error:[/] {error}")
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/]")
        sys.exit(130)
    except Exception as error:
        # Click's own usage errors (an unknown option or command, a missing value), by name:
        # typer vendors click, so its exception classes are not click's.
        if any(kind.__name__ == "ClickException" for kind in type(error).__mro__):
            format_message = getattr(error, "format_message", None)
            message = format_message() if callable(format_message) else str(error)
            names = {(c.name or c.callback.__name__) for c in app.registered_commands if c.callback}
            command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in names else ""
            hint = f"autotune {command} --help" if command else "autotune --help"
            errors.print(f"error: {' '.join(str(message).split())} ({hint} lists the options)",
                         markup=False, highlight=False)  # fmt: skip
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()

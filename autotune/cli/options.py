"""The options several commands share, declared once (typer's ``Annotated`` aliases)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    pass


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
FilterGpus = Annotated[
    int | None, typer.Option("--gpus", min=1, help="Only studies on this many GPUs in all.")
]
FilterSeqLen = Annotated[
    int | None, typer.Option("--seq-len", min=1, help="Only studies of this sequence length.")
]
FilterGlobalBatch = Annotated[
    int | None,
    typer.Option("--global-batch", min=1, help="Only studies of this global batch (sequences)."),
]
FilterStudy = Annotated[
    str | None,
    typer.Option(
        help="The study's name, where several workloads match (see best --json); of one "
        "workload measured with several software versions, the one on this node's, else the "
        "newest, is read unless named."
    ),
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
TpOption = Annotated[
    str | None,
    typer.Option(
        "--tp",
        help="Tensor-parallel degrees to plan, comma-separated (default: powers of two in a "
        "node that split the heads); 1 alone: none.",
    ),
]
PpOption = Annotated[
    str | None,
    typer.Option(
        "--pp",
        help="Pipeline-parallel degrees to plan, comma-separated (default: up to 32 stages, "
        "uneven where the layers do not split); 1 alone: none.",
    ),
]
CpOption = Annotated[
    str | None,
    typer.Option(
        "--cp",
        help="Context-parallel degrees to plan, comma-separated (default: powers of two that "
        "leave each rank 4096 tokens or more); 1 alone: none.",
    ),
]
RunTpOption = Annotated[
    int | None,
    typer.Option(
        "--tp",
        help="Tune under this tensor-parallel degree (with sequence parallelism): every "
        "configuration tried splits its blocks over this many ranks, the rest data-parallel.",
    ),
]
RunPpOption = Annotated[
    int | None,
    typer.Option("--pp", help="Tune under this many pipeline stages (see --pp-schedule)."),
]
RunCpOption = Annotated[
    int | None,
    typer.Option(
        "--cp",
        help="Tune under this context-parallel degree (the simulated GPU: CP probes need a "
        "GPU's attention kernels).",
    ),
]
RunPpScheduleOption = Annotated[
    str | None,
    typer.Option(
        "--pp-schedule",
        help="The pipeline's schedule under --pp: gpipe, 1f1b (default), interleaved-1f1b.",
    ),
]
RunPpVirtualOption = Annotated[
    int | None,
    typer.Option("--pp-virtual", help="Chunks a rank under --pp-schedule interleaved-1f1b."),
]
TpAcrossNodesOption = Annotated[
    bool,
    typer.Option(
        "--tp-across-nodes",
        help="Let tensor parallelism span nodes (its collectives run every layer, over the "
        "network).",
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

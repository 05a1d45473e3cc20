"""``autotune plan``: every configuration ranked by the estimator, without a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from autotune.cli._app import (
    RLHF_OPTIONS,
    UsageError,
    allowed_lora,
    as_flags,
    console,
    print_json,
    rlhf_options,
)
from autotune.cli.options import (
    AcOpsOption,
    ActOffloadOption,
    AllowOption,
    CpOption,
    CriticOption,
    EngineOption,
    FrozenOption,
    GlobalBatchOption,
    HeadroomOption,
    JsonOption,
    LossOption,
    ModelOption,
    OptimizerOption,
    PlanHostCores,
    PlanHostMemory,
    PpOption,
    ReferenceOption,
    ResponseLenOption,
    RewardOption,
    RlhfOption,
    RolloutBatchOption,
    RolloutShareOption,
    SeqLenOption,
    SleepOption,
    TpAcrossNodesOption,
    TpOption,
)
from autotune.config import LORA_RANK, Attention, LossDtype, Precision
from autotune.values import api_arguments, engines_value

if TYPE_CHECKING:
    from autotune.api._plan import Plan


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
    tp: TpOption = None,
    pp: PpOption = None,
    cp: CpOption = None,
    tp_across_nodes: TpAcrossNodesOption = False,
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

    given = dict(locals())  # the options by parameter name: nothing else is bound yet
    if top < 0:
        raise UsageError(f"--top {top}: use a number of rows, or 0 for all")
    rl_options = rlhf_options(
        rlhf,
        ("plans", "planned"),
        as_flags(given, RLHF_OPTIONS),
        as_flags(given, _NOT_RLHF),
        why=" (its trainer climbs the ladder's rungs alone)",
    )
    if rlhf is not None:
        shared = {name: given[name] for name in _RLHF_SHARED}
        _plan_rlhf(rlhf, model, json_output=json_output, **shared, **rl_options)
        return
    found = api.plan(
        model,
        **api_arguments({name: given[name] for name in _PASSED}),
        reserve=api.DEVICE_RESERVE_BYTES if reserve is None else reserve,
        lora_rank=lora_rank if allowed_lora(allow) else None,
        offload=True if offload is None else offload,
        loss_dtype=loss_dtype or LossDtype.FP32,
    )
    if json_output:
        print_json(found.to_dict())
        return
    w = found.workload
    own = ", the loss in the logits' dtype" if w.loss_dtype is LossDtype.LOGITS else ""
    title = (
        f"{found.model.name} on {w.world_size} x {found.gpu.name}, seq {w.seq_len}, global "
        f"batch {w.global_batch}{own}: predicted, not measured"
    )
    console.print(found.host.text(), style="dim", markup=False, highlight=False)
    console.print(plan_table(found.rows, title=title, top=top, seconds=found.seconds))
    following = _next_run(model, found, given)
    if following is not None:
        console.print(following, markup=False, highlight=False)


def _next_run(model: str, found: Plan, given: dict[str, Any]) -> str | None:
    """What to run next: the ``autotune run`` that measures the plan's first row that fits
    and a run can tune (its layout's degrees named; context parallelism is not probed yet),
    on the nodes the plan is for. None where no row fits."""
    import shlex

    from autotune.layouts import layout_flags

    row = next((r for r in found.rows if r.fits and r.config.cp == 1), None)
    if row is None:
        return None
    w = found.workload
    words = ["autotune", "run", "--model", model, "--gpus", str(w.world_size)]
    nodes = -(-w.world_size // given["gpus_per_node"])
    if nodes > 1:
        words += ["--nodes", str(nodes)]
    for option, value in (("--seq-len", w.seq_len), ("--global-batch", w.global_batch)):
        words += [option, str(value)]
    if given["precision"] is not None:
        words += ["--precision", given["precision"].value]
    words += layout_flags(row.config)
    where = "" if given["gpu"] is None else f" on {found.gpu.name} nodes"
    return (
        f"next: {shlex.join(words)}{where} (real probes of the plan's rows, from its best "
        f"that fits, {row.config.label()}; --budget sets how long)"
    )


_NOT_RLHF = ("global_batch", "loss", "optimizer", "allow", "loss_dtype", "tp", "pp", "cp")
"""``plan``'s options an RL iteration's plan does not take, refused with ``--rlhf``."""

_RLHF_SHARED = (
    "gpu",
    "gpus",
    "gpus_per_node",
    "seq_len",
    "engine",
    "precision",
    "offload",
    "reserve",
    "top",
)
"""``plan``'s options an RL iteration's plan takes as the plan does."""

_PASSED = (
    "gpu",
    "gpus",
    "gpus_per_node",
    "seq_len",
    "global_batch",
    "engine",
    "precision",
    "attention",
    "headroom",
    "host_memory",
    "host_cores",
    "loss",
    "ac_ops",
    "act_offload",
    "optimizer",
    "tp",
    "pp",
    "cp",
    "tp_across_nodes",
)
"""``plan``'s options :func:`autotune.api.plan` takes, under the command line's names."""


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
        engines=engines_value(engine),
        reserve=api.DEVICE_RESERVE_BYTES if reserve is None else reserve,
        offload=bool(offload),
        **options,
    )
    if json_output:
        print_json(found.to_dict())
        return
    w = found.workload
    roles = ", ".join(f"{role} {m.name}" for role, m in [*w.models.trained(), *w.models.frozen()])
    title = (
        f"{w.algorithm.value.upper()} on {w.world_size} x {found.gpu.name} ({roles}), seq "
        f"{w.seq_len} ({w.response_len} generated), rollout batch {w.rollout_batch}: "
        "predicted, not measured"
    )
    console.print(rlhf_plan_table(found.rows, title=title, top=top, seconds=found.seconds))

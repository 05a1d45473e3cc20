"""The planner and the search space."""

from __future__ import annotations

import dataclasses
import time

import pytest

from autotune import api
from autotune.config import (
    LADDER_ONLY,
    LOSS_CHUNK_TOKENS,
    PLANNED_KNOBS,
    Attention,
    ConfigError,
    Engine,
    Knobs,
    Loss,
    Optimizer,
    Precision,
)
from autotune.estimator.plan import PlanRow, plan, usable_bytes
from autotune.hardware import gpu_spec
from autotune.models import preset_names, resolve_model
from autotune.space import Workload, configurations, ladder_key, micro_batch_options

LOSSES_ONLY = dataclasses.replace(LADDER_ONLY, losses=(Loss.FULL, Loss.CHUNKED))
"""The ladder and the chunked loss: each chunked row's twin is in the plan."""
OPS_ONLY = dataclasses.replace(LADDER_ONLY, op_checkpointing=True)
"""The ladder and op-level checkpointing: each ac:ops row's twin is in the plan."""


def test_workload_keeps_the_global_batch_exact() -> None:
    work = Workload(seq_len=4096, global_batch=512, world_size=8)
    assert micro_batch_options(work) == [1, 2, 4, 8, 16, 32, 64]
    assert all(m * 8 * work.grad_accum(m) == 512 for m in micro_batch_options(work))
    with pytest.raises(ConfigError, match="multiple of 8 GPUs"):
        micro_batch_options(Workload(seq_len=2048, global_batch=100, world_size=8))
    with pytest.raises(ConfigError, match="divisor"):
        work.grad_accum(3)


def test_space_is_valid_and_in_ladder_order() -> None:
    one = configurations(world_size=1, num_layers=32)
    eight = configurations(world_size=8, num_layers=32)
    assert all(c.engine is not Engine.DDP for c in one)  # nothing to replicate on one GPU
    assert {c.engine for c in eight} == {Engine.DDP, Engine.FSDP, Engine.DEEPSPEED}
    assert eight == sorted(eight, key=ladder_key)
    assert eight[0].zero_stage == 0 and eight[0].ac_every == 0  # the cheapest rung first
    assert len(set(eight)) == len(eight)
    only = configurations(world_size=8, num_layers=32, engines=[Engine.FSDP])
    assert only and all(c.engine is Engine.FSDP for c in only)


def test_plan_ranks_fitting_configurations_by_throughput() -> None:
    rows = plan(
        resolve_model("llama-7b"),
        gpu_spec("h100-80gb"),
        Workload(seq_len=4096, global_batch=512, world_size=8),
    )
    fitting = [r for r in rows if r.fits]
    missing = [r for r in rows if not r.fits]
    assert fitting and missing
    assert rows[: len(fitting)] == fitting  # fitting first
    speeds = [r.tokens_per_second for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.memory.peak_bytes <= r.capacity_bytes for r in fitting)
    assert all(r.over_bytes > 0 and r.time is None for r in missing)
    # DDP replicates 20 bytes a parameter: 135 GB for llama-7b, more than an 80 GB GPU holds.
    assert all(r.config.engine is not Engine.DDP for r in fitting)
    best = fitting[0]
    assert best.micro_batch_size * 8 * best.grad_accum == 512
    assert 0.2 < (best.time.mfu or 0) < 0.7 if best.time else False


def test_plan_headroom_shrinks_what_fits() -> None:
    args = (
        resolve_model("llama-7b"),
        gpu_spec("a100-40gb"),
        Workload(seq_len=2048, global_batch=64, world_size=8),
    )
    loose = plan(*args)
    tight = plan(*args, headroom=0.3)
    assert sum(r.fits for r in tight) < sum(r.fits for r in loose)
    assert usable_bytes(gpu_spec("a100-40gb"), headroom=0.3) < loose[0].capacity_bytes


def test_plan_covers_every_preset_and_a_70b_model_on_64_gpus_quickly() -> None:
    for name in preset_names():
        rows = plan(
            resolve_model(name),
            gpu_spec("h100"),
            Workload(seq_len=2048, global_batch=64, world_size=8),
        )
        assert rows
    model = resolve_model("llama-70b")
    started = time.perf_counter()
    rows = plan(
        model, gpu_spec("h100-80gb"), Workload(seq_len=4096, global_batch=1024, world_size=64)
    )
    elapsed = time.perf_counter() - started
    print(f"llama-70b on 64 GPUs: {len(rows)} configurations planned in {elapsed * 1000:.0f} ms")
    assert any(r.fits for r in rows)


def test_a_plan_for_another_node_takes_no_host_figure_of_this_one() -> None:
    """``plan --gpu h100-80gb`` on a machine without that GPU: the host is taken to hold at
    most what the largest DGX-class node holds (4 TiB), and host Adam gets 16 cores per GPU,
    each said with where it comes from; ``--host-memory`` and ``--host-cores`` set them, and
    more cores make host Adam (offload) faster."""
    from autotune import api
    from autotune.api._plan import LARGEST_NODE_HOST_BYTES
    from autotune.config import Offload

    other = api.plan("llama-7b", gpu="h100-80gb", gpus=8)
    assert other.host.memory_bytes == LARGEST_NODE_HOST_BYTES and other.host.cores is None
    assert "give --host-memory" in other.host.text() and "16 cores per GPU" in other.host.text()
    assert all(row.host_fits for row in other.rows)  # a 7B model's offload fits such a node
    given = api.plan("llama-7b", gpu="h100-80gb", gpus=8, host_memory="1TiB", host_cores=224)
    assert given.host.memory_bytes == 1 << 40 and given.host.cores == 224
    assert given.to_dict()["host"]["cores_from"] == "--host-cores"

    config = next(r.config for r in other.rows if r.config.offload is Offload.OPTIMIZER and r.time)
    speeds = [next(r for r in p.rows if r.config == config).speeds for p in (other, given)]
    assert all(speeds[1][m] > speeds[0][m] for m in speeds[0])  # 28 cores per GPU, not 16


def test_the_chunked_loss_follows_its_twin_on_the_ladder() -> None:
    """Each configuration with the chunked loss comes after the same one with the model's own
    loss, with nothing between them on another rung (offload, sharding or checkpointing)."""
    space = configurations(world_size=8, num_layers=32)
    for index, config in enumerate(space):
        if config.loss is Loss.CHUNKED:
            twin = space.index(dataclasses.replace(config, loss=Loss.FULL))
            assert twin < index
            rung = ladder_key(config)[:4]  # LoRA or not, offload, sharding, checkpointing
            assert all(ladder_key(c)[:4] == rung for c in space[twin : index + 1])
    assert all(
        c.loss is Loss.FULL for c in configurations(world_size=1, num_layers=32, knobs=OPS_ONLY)
    )
    with pytest.raises(ConfigError, match="no loss to try"):
        Knobs(losses=())


@pytest.mark.parametrize(
    ("model", "gpus", "seq_len", "global_batch"),
    [("qwen2.5-1.5b", 1, 2048, 8), ("qwen2.5-1.5b", 1, 4096, 32), ("llama-7b", 8, 4096, 256)],
)
def test_the_chunked_loss_is_planned_only_where_it_pays(
    model: str, gpus: int, seq_len: int, global_batch: int
) -> None:
    """A chunked row fits a larger micro-batch than its twin with the model's own loss (or its
    twin fits nothing); every twin is there; the chunked row is slower at the same size (one
    more forward of the output layer) and never heavier from two chunks on."""
    spec, gpu = resolve_model(model), gpu_spec("h100-80gb")
    work = Workload(seq_len=seq_len, global_batch=global_batch, world_size=gpus)
    rows = plan(spec, gpu, work, knobs=LOSSES_ONLY)  # each chunked row's twin is there
    full = {r.config: r for r in rows if r.config.loss is Loss.FULL}
    chunked = [r for r in rows if r.config.loss is Loss.CHUNKED]
    assert chunked, "the logits of a 152k or 32k vocabulary stop some micro-batch"

    def largest(row: PlanRow) -> int:
        return max((m for m, p in row.peaks.items() if p <= row.capacity_bytes), default=0)

    for row in chunked:
        twin = full[dataclasses.replace(row.config, loss=Loss.FULL)]
        assert largest(row) > largest(twin)
        for mbs in row.speeds:
            assert row.speeds[mbs] < twin.speeds[mbs]
            if mbs * seq_len >= 2 * LOSS_CHUNK_TOKENS:
                assert row.peaks[mbs] <= twin.peaks[mbs]
    only_full = plan(spec, gpu, work, knobs=LADDER_ONLY)
    assert len(only_full) == len(full)


def test_the_chunked_loss_replaces_checkpointing_where_the_logits_stop_the_batch() -> None:
    """qwen2.5-1.5b (vocabulary 151,936) on one L40S (48 GB), accumulating (the fp32 gradients
    kept between micro-steps): without checkpointing the model's own loss fits micro-batch 1,
    the chunked one 2, which the plan ranks above checkpointing every 4th block (one more
    forward of the output layer costs less)."""
    rows = plan(
        resolve_model("qwen2.5-1.5b"),
        gpu_spec("l40s"),
        Workload(seq_len=2048, global_batch=8, world_size=1),
        knobs=LOSSES_ONLY,
    )
    best = rows[0]
    assert best.fits and best.config.loss is Loss.CHUNKED and best.config.ac_every == 0
    by_label = {r.config.label(): r for r in rows}
    assert by_label["single ac:off"].micro_batch_size < best.micro_batch_size
    assert by_label["single ac:every-4"].tokens_per_second < best.tokens_per_second


def test_op_level_checkpointing_is_a_rung_between_none_and_every_fourth_block() -> None:
    """On the ladder ac:ops comes after no checkpointing and before every 4th block, in each
    sharding; a user's script's space (the ladder alone) has none of it."""
    space = configurations(world_size=8, num_layers=32, knobs=OPS_ONLY)
    for index, config in enumerate(space):
        if config.ac_ops:
            assert config.ac_every == 0
            off = space.index(dataclasses.replace(config, ac_ops=False))
            every4 = space.index(dataclasses.replace(config, ac_ops=False, ac_every=4))
            assert off < index < every4
    plain = configurations(world_size=8, num_layers=32, knobs=LOSSES_ONLY)
    assert plain and not any(c.ac_ops for c in plain)


@pytest.mark.parametrize(
    ("model", "gpu", "gpus", "seq_len", "global_batch"),
    [("llama-7b", "h100-80gb", 8, 4096, 512), ("qwen2.5-1.5b", "a100-40gb", 1, 2048, 64)],
)
def test_op_level_checkpointing_is_planned_only_where_it_pays(
    model: str, gpu: str, gpus: int, seq_len: int, global_batch: int
) -> None:
    """An ac:ops row fits a larger micro-batch than the same configuration without it, and is
    slower than it at the same size and faster than checkpointing every block whole."""
    rows = plan(
        resolve_model(model),
        gpu_spec(gpu),
        Workload(seq_len=seq_len, global_batch=global_batch, world_size=gpus),
        knobs=OPS_ONLY,  # each ac:ops row's twin is there
    )
    by_config = {r.config: r for r in rows}
    selective = [r for r in rows if r.config.ac_ops]
    assert selective

    def largest(row: PlanRow) -> int:
        return max((m for m, p in row.peaks.items() if p <= row.capacity_bytes), default=0)

    for row in selective:
        twin = by_config.get(dataclasses.replace(row.config, ac_ops=False))
        if twin is not None:
            assert largest(row) > largest(twin)
            assert all(row.speeds[m] < twin.speeds[m] for m in row.speeds)
        whole = by_config.get(dataclasses.replace(row.config, ac_ops=False, ac_every=1))
        if whole is not None:
            assert all(row.speeds[m] > whole.speeds[m] for m in row.speeds)


def test_plan_leaves_out_op_level_checkpointing_when_told() -> None:
    """``plan --no-ac-ops``: no ac:ops row; by default the qwen2.5-1.5b plan on an A100 40GB
    has some (they fit micro-batches the same rung without them cannot)."""
    from autotune import api

    with_ops = api.plan("qwen2.5-1.5b", gpu="a100-40gb", gpus=1, global_batch=64)
    without = api.plan(
        "qwen2.5-1.5b", gpu="a100-40gb", gpus=1, global_batch=64, op_checkpointing=False
    )
    assert any(r.config.ac_ops for r in with_ops.rows)
    assert not any(r.config.ac_ops for r in without.rows)


OPTIMIZERS_ONLY = dataclasses.replace(LADDER_ONLY, optimizers=tuple(Optimizer))
"""The ladder and 8-bit AdamW: each 8-bit row's twin is in the plan."""


def test_8bit_adamw_is_planned_only_where_it_pays() -> None:
    """llama-7b on one H100: fused AdamW's 16 bytes a parameter fit only with offload, 8-bit
    AdamW's 10 fit without, and that row is the plan's best where nothing accumulates (with
    accumulation the fp32 gradients kept through the forward leave it micro-batch 2, and
    parameter offload at the whole batch is faster). Every 8-bit row fits a larger
    micro-batch than its twin with fused AdamW, is never faster at the same size, and none
    pairs with DeepSpeed or offload; the ladder alone has none."""
    spec, gpu = resolve_model("llama-7b"), gpu_spec("h100-80gb")
    one_step = plan(spec, gpu, Workload(seq_len=2048, global_batch=1, world_size=1))[0]
    assert one_step.config.optimizer is Optimizer.ADAMW_8BIT
    assert one_step.config.engine is Engine.SINGLE
    work = Workload(seq_len=2048, global_batch=64, world_size=1)
    best = plan(spec, gpu, work)[0]
    assert best.config.offload.value == "params" and best.grad_accum == 1
    rows = plan(spec, gpu, work, knobs=OPTIMIZERS_ONLY)
    fused = {r.config: r for r in rows if r.config.optimizer is Optimizer.ADAMW}
    eight = [r for r in rows if r.config.optimizer is Optimizer.ADAMW_8BIT]
    assert eight and all(r.config.offload.value == "none" for r in eight)

    def largest(row: PlanRow) -> int:
        return max((m for m, p in row.peaks.items() if p <= row.capacity_bytes), default=0)

    for row in eight:
        assert row.config.engine is not Engine.DEEPSPEED
        twin = fused[dataclasses.replace(row.config, optimizer=Optimizer.ADAMW)]
        assert largest(row) > largest(twin)
        assert all(row.speeds[m] <= twin.speeds[m] for m in row.speeds)
    assert not any(
        r.config.optimizer is Optimizer.ADAMW_8BIT for r in plan(spec, gpu, work, knobs=LADDER_ONLY)
    )


def test_flash_attn_is_planned_as_sdpas_flash_kernel() -> None:
    """flash-attn's FlashAttention-2 keeps what sdpa's flash kernel keeps and runs at its
    efficiency: the same plan, row by row; eager attention's scores make it heavier."""
    spec, gpu = resolve_model("qwen2.5-1.5b"), gpu_spec("h100-80gb")
    work = Workload(seq_len=4096, global_batch=32, world_size=1)
    sdpa = plan(spec, gpu, work, knobs=LADDER_ONLY)
    flash = plan(spec, gpu, work, attention=Attention.FLASH, knobs=LADDER_ONLY)
    eager = {r.config.label(): r for r in plan(spec, gpu, work, attention=Attention.EAGER)}
    assert [r.config.label() + " flash_attention_2" for r in sdpa] == [
        r.config.label() for r in flash
    ]
    strictly = 0
    for a, b in zip(sdpa, flash, strict=True):
        assert a.peaks == b.peaks and a.speeds == b.speeds
        heavier = eager[a.config.label() + " eager"].peaks
        assert all(heavier[m] >= a.peaks[m] for m in a.peaks)
        strictly += sum(heavier[m] > a.peaks[m] for m in a.peaks)
    assert strictly > len(sdpa)  # where the logits do not set the peak


def test_lora_rows_follow_the_full_fine_tuning_that_fits() -> None:
    """``--allow lora``: LoRA rows (the plain engines, no offload) rank after every full
    fine-tuning row that fits, faster or not; where none fits (llama-7b on one RTX 4090 with
    64 GiB of host memory: offload needs more), a LoRA row is first."""
    spec = resolve_model("llama-7b")
    knobs = dataclasses.replace(PLANNED_KNOBS, lora_rank=16)
    workload = Workload(seq_len=2048, global_batch=8, world_size=1)
    roomy = plan(spec, gpu_spec("a100-40gb"), workload, knobs=knobs)
    lora = [i for i, r in enumerate(roomy) if r.config.is_lora]
    full_fitting = [i for i, r in enumerate(roomy) if r.fits and not r.config.is_lora]
    assert lora and full_fitting and max(full_fitting) < min(lora)
    assert all(r.config.engine is Engine.SINGLE and r.config.lora_rank == 16
               for r in roomy if r.config.is_lora)  # fmt: skip
    fastest_lora = max((r for r in roomy if r.config.is_lora and r.fits),
                       key=lambda r: r.tokens_per_second)  # fmt: skip
    assert fastest_lora.tokens_per_second > roomy[0].tokens_per_second  # fewer FLOPs a token
    tight = plan(spec, gpu_spec("rtx4090"), workload, knobs=knobs, host_memory_bytes=64 * 2**30)
    assert tight[0].fits and tight[0].config.is_lora
    assert not any(r.fits for r in tight if not r.config.is_lora)
    assert not any(r.config.is_lora for r in plan(spec, gpu_spec("rtx4090"), workload))


def test_a_plan_for_a_loss_in_the_logits_dtype_counts_no_fp32_copy() -> None:
    """``plan --loss-dtype logits`` (a job whose loss takes bf16 logits as they are): in pure
    bf16 every row's peak is 4 bytes a vocabulary entry a token lower at the same size, the
    workload says so in the JSON, and an unknown dtype is one line."""
    model = resolve_model("qwen2.5-1.5b")

    def peaks(loss_dtype: str) -> dict[tuple[object, int], float]:
        found = api.plan(
            model, gpu="h100-80gb", gpus=8, precision=Precision.BF16, loss_dtype=loss_dtype,
            losses="full", host_memory="1TiB", host_cores=64, tp="1", pp="1", cp="1",
        )  # fmt: skip
        assert found.to_dict()["loss_dtype"] == loss_dtype
        return {(r.config, m): p for r in found.rows for m, p in r.peaks.items()}

    own, upcast = peaks("logits"), peaks("fp32")  # knob rows kept where they pay: fewer
    common = own.keys() & upcast.keys()
    assert len(common) > 40
    for config, mbs in common:
        tokens = mbs * 2048
        saved = upcast[(config, mbs)] - own[(config, mbs)]
        # The CUDA allocator's share of the activations moves with them (2-12 %).
        assert 4 * model.vocab_size * tokens <= saved <= 1.13 * 4 * model.vocab_size * tokens
    with pytest.raises(ConfigError, match="unknown loss dtype 'bf16': use one of fp32, logits"):
        api.plan(model, gpu="h100-80gb", gpus=8, loss_dtype="bf16")


def test_a_plan_for_another_node_fits_no_row_that_needs_more_host_than_any_node_holds() -> None:
    """llama3.1-405b offloaded on 128 H100s needs terabytes of host memory a node: without
    ``--host-memory`` a row that needs more than the largest DGX-class node holds does not
    fit, and says why."""
    from autotune import api
    from autotune.api._plan import LARGEST_NODE_HOST_BYTES

    found = api.plan("llama3.1-405b", gpu="h100-80gb", gpus=128)
    hungry = [r for r in found.rows if r.host and r.host.node_bytes > LARGEST_NODE_HOST_BYTES]
    assert hungry, "no row needs more host memory than a node holds: the check checks nothing"
    assert not any(r.fits for r in hungry)
    assert all((r.miss or "").startswith("host: needs") for r in hungry)

"""Tensor- and pipeline-parallel probes on the CPU (gloo, 2 and 4 real rank processes,
torch's DTensor plans and pipelining schedules): they train, their throughput counts the
data-parallel ranks' tokens only, their peaks meet the layout estimator on shapes its terms
were not written on (bench/layout_probes.py's held-out group, docs/parallelism.md), and the
emulated device limit stops one as it stops any probe.
"""

from __future__ import annotations

import pytest
from conftest import RunProbe

from autotune.config import Engine, Schedule, TrainConfig
from autotune.estimator.parallel import estimate_layout_memory
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome

TP2 = TrainConfig(tp=2)
FSDP_TP = TrainConfig(engine=Engine.FSDP, zero_stage=3, tp=2, ac_every=1)


@pytest.mark.parametrize(
    ("config", "ranks", "model", "seq_len", "size"),
    [(TP2, 2, "tiny-qwen", 96, 5), (FSDP_TP, 4, "tiny-qwen", 320, 1)],
    ids=["tp2", "fsdp2xtp2"],
)
def test_a_tensor_parallel_probe_trains_and_meets_its_estimate(
    run_probe: RunProbe, config: TrainConfig, ranks: int, model: str, seq_len: int, size: int
) -> None:
    result = run_probe(
        config, model=model, num_processes=ranks, seq_len=seq_len, micro_batch_sizes=(size,),
        warmup_steps=1, timed_steps=3,
    )  # fmt: skip
    assert result.outcome is Outcome.OK, result
    measured = result.sizes[0]
    assert measured.outcome is Outcome.OK
    assert measured.losses[-1] < measured.losses[0]  # it learns
    # Every rank of a TP group trains on the same sequences: one data-parallel rank's tokens.
    dp = ranks // config.tp
    step = measured.step_s
    assert measured.tokens_per_second == pytest.approx(size * seq_len * dp / step, rel=1e-6)
    estimate = estimate_layout_memory(
        resolve_model(model), config, micro_batch_size=size, seq_len=seq_len, world_size=ranks,
        grad_accum=1, cuda_allocator=False,
    )  # fmt: skip
    assert measured.peak_bytes is not None
    assert estimate.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.15)


def test_a_tensor_parallel_probe_over_its_limit_runs_out_of_memory(run_probe: RunProbe) -> None:
    result = run_probe(
        TP2, num_processes=2, seq_len=128, micro_batch_sizes=(1, 16), device_memory_bytes=2**21
    )
    by_size = {s.micro_batch_size: s.outcome for s in result.sizes}
    assert by_size[1] is Outcome.OK
    assert by_size[16] is Outcome.OOM


@pytest.mark.parametrize(
    ("config", "seq_len", "size", "microbatches"),
    [
        (TrainConfig(pp=2, ac_ops=True), 160, 3, 2),
        (TrainConfig(pp=2, ac_every=1, pp_schedule=Schedule.GPIPE), 80, 2, 3),
    ],
    ids=["1f1b", "gpipe"],
)
def test_a_pipeline_probe_trains_and_meets_its_estimate(
    run_probe: RunProbe, config: TrainConfig, seq_len: int, size: int, microbatches: int
) -> None:
    result = run_probe(
        config, num_processes=2, seq_len=seq_len, micro_batch_sizes=(size,),
        grad_accum=microbatches, warmup_steps=1, timed_steps=3,
    )  # fmt: skip
    assert result.outcome is Outcome.OK, result
    measured = result.sizes[0]
    assert measured.losses[-1] < measured.losses[0]
    # One pipeline: the step's tokens are one rank's micro-batches, over the step's time.
    tokens = size * seq_len * microbatches
    assert measured.tokens_per_second == pytest.approx(tokens / measured.step_s, rel=1e-6)
    estimate = estimate_layout_memory(
        resolve_model("tiny"), config, micro_batch_size=size, seq_len=seq_len, world_size=2,
        grad_accum=microbatches, cuda_allocator=False,
    )  # fmt: skip
    assert measured.peak_bytes is not None
    assert estimate.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.15)

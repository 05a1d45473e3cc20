"""The engines a user's job trains under when asked, learnt from its probes
(``study.measurement.measured_engines``), and the search space they leave
(``space.configurations(job_engines=...)``).

The probes are written as the study records them: a probe whose job trained under another
engine than asked is a FAIL trial of outcome ``other_engine`` with the engine that trained
(``trained_engine``, ``trained_zero_stage``); one that trained as asked is ``ok`` with its own.
The cases are the jobs a cluster user has: a script that always shards with FSDP2, a Trainer
whose arguments carry no DeepSpeed config (DDP whatever is asked), a script that follows the
ask for DDP and FSDP but has no DeepSpeed branch, and one with a DeepSpeed config of its own.
The real probes of such jobs: tests/probe/test_userjob_engine.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from autotune.config import LADDER_ONLY, Engine, TrainConfig
from autotune.space import JobEngine, Workload, configurations
from autotune.study.measurement import (
    OTHER_ENGINE,
    Measurement,
    measured_engines,
    measured_workload,
)

DDP = TrainConfig(engine=Engine.DDP)
FSDP = TrainConfig(engine=Engine.FSDP, zero_stage=3)
SINGLE = TrainConfig()


def ds(stage: int) -> TrainConfig:
    return TrainConfig(engine=Engine.DEEPSPEED, zero_stage=stage)


def probe(number: int, asked: TrainConfig, engine: Engine, stage: int | None = None) -> Measurement:
    """A probe of ``asked`` whose job trained under ``engine`` (at DeepSpeed's ``stage``)."""
    same = JobEngine.of(engine, stage).alike(JobEngine.of(asked.engine, asked.zero_stage), 2)
    attrs: dict[str, Any] = {"trained_engine": engine.value, "trained_zero_stage": stage}
    return Measurement(
        number=number,
        config=asked,
        micro_batch_size=1,
        state="COMPLETE" if same else "FAIL",
        outcome="ok" if same else OTHER_ENGINE,
        feasible=same,
        value=1.0 if same else None,
        attrs=attrs,
    )


def names(engines: tuple[JobEngine, ...] | None, world: int = 2) -> list[str] | None:
    return None if engines is None else [e.text(world) for e in engines]


def test_a_job_that_trains_as_asked_leaves_every_engine() -> None:
    seen = [probe(0, DDP, Engine.DDP), probe(1, ds(2), Engine.DEEPSPEED, 2)]
    assert measured_engines(seen, 2) is None
    work = Workload(seq_len=64, global_batch=8, world_size=2)
    assert measured_workload(work, seen) == work


def test_a_job_that_always_shards_with_fsdp2_is_kept_to_fsdp() -> None:
    """Asked DDP, it trained FSDP2: FSDP alone, from that one probe; its FSDP probes after
    (trained as asked, as it would anyway) show no other engine it follows."""
    first = [probe(0, DDP, Engine.FSDP)]
    assert names(measured_engines(first, 2)) == ["fsdp"]
    later = [*first, probe(1, FSDP, Engine.FSDP), probe(2, FSDP, Engine.FSDP)]
    assert names(measured_engines(later, 2)) == ["fsdp"]


def test_a_job_that_follows_ddp_and_fsdp_loses_only_the_engine_it_does_not_run() -> None:
    """A script with DDP and FSDP branches and no DeepSpeed one (DeepSpeed asked: DDP): seen
    following FSDP, it keeps DDP and FSDP and loses every DeepSpeed stage at once."""
    seen = [probe(0, DDP, Engine.DDP), probe(1, FSDP, Engine.FSDP), probe(2, ds(1), Engine.DDP)]
    assert names(measured_engines(seen, 2)) == ["ddp", "fsdp"]


def test_a_job_with_a_deepspeed_stage_of_its_own_keeps_deepspeed_to_that_stage() -> None:
    own = [probe(0, ds(1), Engine.DEEPSPEED, 2)]
    assert names(measured_engines(own, 2)) == ["deepspeed z2"]
    # Seen following DDP too: DDP and FSDP stay, DeepSpeed at its own stage alone.
    both = [probe(0, DDP, Engine.DDP), *own]
    assert names(measured_engines(both, 2)) == ["ddp", "fsdp", "deepspeed z2"]


def test_at_one_rank_no_wrapper_and_ddp_are_one_engine() -> None:
    """A torchrun script that wraps its lone rank in DDP, asked FSDP: the plain engines, whether
    the space asks for one process or DDP."""
    seen = [probe(0, FSDP, Engine.DDP)]
    engines = measured_engines(seen, 1)
    assert names(engines, 1) == ["single or ddp"]
    assert engines is not None
    work = Workload(seq_len=64, global_batch=8, world_size=1, job_engines=engines)
    assert {c.engine for c in configurations(world_size=1, num_layers=2, job_engines=engines)} == {
        Engine.SINGLE
    }
    assert measured_workload(Workload(seq_len=64, global_batch=8, world_size=1), seen) == work


@pytest.mark.parametrize("world", [1, 2])
def test_the_space_keeps_to_the_jobs_engines_and_shards_one_gpu_where_the_job_does(
    world: int,
) -> None:
    """On one GPU the ladder tries no sharding without offload (nothing to shard over); a job
    that always shards is tried so, as it trains."""
    plain = configurations(world_size=world, num_layers=2, offload=False, knobs=LADDER_ONLY)
    assert all(c.engine is not Engine.FSDP for c in plain) or world > 1
    kept = configurations(
        world_size=world,
        num_layers=2,
        offload=False,
        knobs=LADDER_ONLY,
        job_engines=(JobEngine(Engine.FSDP),),
    )
    assert kept and {c.engine for c in kept} == {Engine.FSDP}
    assert {c.ac_every for c in kept} == {0, 1}
    stage = configurations(
        world_size=world, num_layers=2, job_engines=(JobEngine(Engine.DEEPSPEED, 2),)
    )
    assert stage and {(c.engine, c.zero_stage) for c in stage} == {(Engine.DEEPSPEED, 2)}

"""The tie-break: the best and a rival, each measured twice, are measured again while their
means stay within ``TIE_MARGIN`` of each other (wider where the repeats show more noise) and
their repeats scatter, up to ``MAX_REPEATS`` each, the less measured first."""

from __future__ import annotations

from autotune.config import TrainConfig
from autotune.estimator.plan import PlanRow, plan
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.search.ladder import MAX_REPEATS, TIE_MARGIN, propose
from autotune.space import Workload, micro_batch_options
from autotune.study.measurement import Measurement

WORK = Workload(seq_len=2048, global_batch=64, world_size=1)
A, B = TrainConfig(), TrainConfig(ac_every=4)


def _rows() -> list[PlanRow]:
    return plan(resolve_model("qwen2.5-1.5b"), gpu_spec("h100-80gb"), WORK)


def record(
    found: list[Measurement],
    config: TrainConfig,
    mbs: int,
    outcome: str,
    value: float,
    repeat: int = 0,
) -> None:
    """A complete trial appended to ``found`` (numbered after its last)."""
    found.append(
        Measurement(
            number=len(found), config=config, micro_batch_size=mbs, state="COMPLETE",
            outcome=outcome, feasible=outcome == "ok", value=value, repeat=repeat,
            peak_bytes=1,
        )
    )  # fmt: skip


def _study(rows: list[PlanRow], a: list[float], b: list[float]) -> list[Measurement]:
    """Every configuration measured to its limit far below A and B (so only they are left),
    A at micro-batch 4 with the values ``a`` and B with ``b``, one trial per measurement."""
    found: list[Measurement] = []

    def add(config: TrainConfig, mbs: int, outcome: str, value: float, repeat: int = 0) -> None:
        record(found, config, mbs, outcome, value, repeat)

    for row in rows:
        sizes = [m for m in micro_batch_options(WORK) if m in row.speeds]
        values = {A: a, B: b}.get(row.config)
        for mbs in sizes:
            if values is not None and mbs == 4:
                for repeat, value in enumerate(values):
                    add(row.config, mbs, "ok", value, repeat)
            else:
                add(row.config, mbs, "ok", 1000.0)
        add(row.config, 2 * max(sizes), "oom", 0.0)
    return found


def test_two_scattered_means_within_the_margin_are_measured_again_until_the_cap() -> None:
    rows = _rows()
    sizes = micro_batch_options(WORK)
    study = _study(rows, [40_000, 40_600], [40_200, 40_700])  # means 0.25 % apart
    proposal = propose(rows, study, sizes)
    assert proposal is not None and proposal.reason.startswith("tie-break")
    assert proposal.micro_batch_sizes == (4,) and proposal.repeat == 2
    # Each measured MAX_REPEATS times: the means stand.
    capped = _study(
        rows, [40_000, 40_600] * (MAX_REPEATS // 2), [40_200, 40_700] * (MAX_REPEATS // 2)
    )
    assert len([m for m in capped if m.config == A and m.micro_batch_size == 4]) == MAX_REPEATS
    assert propose(rows, capped, sizes) is None


def test_means_apart_or_measured_alike_every_time_are_not_measured_again() -> None:
    rows = _rows()
    sizes = micro_batch_options(WORK)
    apart = 40_000 * (1 - 2 * TIE_MARGIN)
    assert propose(rows, _study(rows, [40_000, 40_100], [apart, apart + 100]), sizes) is None
    # No scatter among the repeats: more measurements cannot tell them apart.
    assert propose(rows, _study(rows, [40_000, 40_000], [40_100, 40_100]), sizes) is None

"""The search's invariants over random studies (hypothesis).

Whatever a study holds (configurations measured ok at some sizes, out of memory from some
size up, failed, interrupted, running on another worker, re-measured), the next proposal of
``ladder.propose``:

- never includes a size that an out-of-memory at a smaller or equal size of the same
  configuration ruled out;
- never measures a point twice: a first measurement's sizes were never measured, failed or
  left running, and a re-measurement (``repeat`` n) is of a point measured ok exactly n times
  so far, never of one that ran out of memory;
- never touches a configuration that is running elsewhere or failed for good.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.config import TrainConfig
from autotune.estimator.plan import PlanRow, plan
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.search.ladder import propose
from autotune.space import Workload, micro_batch_options
from autotune.study.measurement import Measurement

WORKLOADS = (
    ("llama-7b", "h100-80gb", 8, 2048, 64),
    ("qwen2.5-1.5b", "a100-40gb", 8, 4096, 128),
    ("llama-13b", "a100-80gb", 8, 4096, 64),
)


@functools.cache
def _space(index: int) -> tuple[list[PlanRow], list[int]]:
    model, gpu, gpus, seq_len, batch = WORKLOADS[index]
    workload = Workload(seq_len=seq_len, global_batch=batch, world_size=gpus)
    return plan(resolve_model(model), gpu_spec(gpu), workload), micro_batch_options(workload)


@st.composite
def studies(draw: st.DrawFn) -> tuple[int, list[Measurement]]:
    """A workload and a study of it: each drawn configuration measured ok at some sizes below
    its first out-of-memory size (if any), and some trials failed, interrupted or running."""
    index = draw(st.integers(0, len(WORKLOADS) - 1))
    rows, sizes = _space(index)
    # Up to every configuration, so that some studies are finished and only near-ties (the
    # measured speeds are drawn close together) are left to re-measure.
    finished = draw(st.booleans())  # every configuration measured up to its limit
    chosen = (
        list(range(len(rows)))
        if finished
        else draw(st.lists(st.integers(0, len(rows) - 1), max_size=len(rows), unique=True))
    )
    low = draw(st.floats(1e3, 1e5))
    measurements: list[Measurement] = []

    def add(config: TrainConfig, mbs: int, state: str, outcome: str | None, **kw: object) -> None:
        measurements.append(
            Measurement(
                number=len(measurements), config=config, micro_batch_size=mbs, state=state,
                outcome=outcome, feasible=outcome == "ok", **kw,  # type: ignore[arg-type]
            )
        )  # fmt: skip

    for row in (rows[i] for i in chosen):
        config = row.config
        oom_at = draw(st.sampled_from([None, *range(len(sizes))]))
        below = sizes if oom_at is None else sizes[:oom_at]
        every = finished or draw(st.booleans())  # each size below the OOM measured
        measured = (
            below if every or not below else draw(st.lists(st.sampled_from(below), unique=True))
        )
        for mbs in measured:
            value = draw(st.floats(low, low * 1.05))
            peak = int(row.peak_at(mbs) * draw(st.floats(0.7, 1.0)))
            repeats = draw(st.sampled_from([1, 1, 1, 2, 3]))
            for repeat in range(repeats):
                add(config, mbs, "COMPLETE", "ok", value=value, peak_bytes=peak, repeat=repeat)
        if oom_at is not None:
            add(config, sizes[oom_at], "COMPLETE", "oom", value=0.0)
        extra = draw(st.sampled_from([None, None, "error", "interrupted", "running"]))
        free = [m for m in below if m not in {x.micro_batch_size for x in measurements
                                              if x.config == config}]  # fmt: skip
        if extra is not None and free:
            mbs = draw(st.sampled_from(free))
            if extra == "running":
                add(config, mbs, "RUNNING", None, value=None)
            else:
                add(config, mbs, "FAIL", extra, value=None)
    return index, measurements


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(studies())
def test_a_proposal_never_repeats_a_point_nor_defies_an_oom(
    study: tuple[int, list[Measurement]],
) -> None:
    index, measurements = study
    rows, sizes = _space(index)
    proposal = propose(rows, measurements, sizes)
    if proposal is None:
        return
    mine = [m for m in measurements if m.config == proposal.config]
    ooms = [m.micro_batch_size for m in mine if m.outcome == "oom"]
    assert all(mbs < min(ooms) for mbs in proposal.micro_batch_sizes) if ooms else True
    assert not any(m.state == "RUNNING" for m in mine), "a configuration running elsewhere"
    assert not any(m.outcome == "error" for m in mine), "a configuration that failed for good"
    assert list(proposal.micro_batch_sizes) == sorted(set(proposal.micro_batch_sizes))
    assert set(proposal.micro_batch_sizes) <= set(sizes)
    runs: dict[int, int] = defaultdict(int)
    for m in mine:
        if m.outcome == "ok":
            runs[m.micro_batch_size] += 1
    if proposal.repeat == 0:
        measured = {m.micro_batch_size for m in mine if m.outcome != "interrupted"}
        assert not measured & set(proposal.micro_batch_sizes), (proposal, mine)
    else:
        [mbs] = proposal.micro_batch_sizes
        assert runs[mbs] == proposal.repeat, (proposal, mine)

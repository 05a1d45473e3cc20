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

import dataclasses
import functools
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.config import PLANNED_KNOBS, TrainConfig
from autotune.estimator.plan import PlanRow, plan
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.search.ladder import Proposal, propose
from autotune.space import Workload, micro_batch_options, oom_rules_out
from autotune.study.measurement import Measurement

T = TypeVar("T")

WORKLOADS = (
    ("llama-7b", "h100-80gb", 8, 2048, 64),
    ("qwen2.5-1.5b", "a100-40gb", 8, 4096, 128),
    ("llama-13b", "a100-80gb", 8, 4096, 64),
)


@functools.cache
def _space(index: int) -> tuple[list[PlanRow], list[int]]:
    model, gpu, gpus, seq_len, batch = WORKLOADS[index]
    workload = Workload(seq_len=seq_len, global_batch=batch, world_size=gpus)
    # The planned knobs but activation offload (its rows add time here, not branches).
    knobs = dataclasses.replace(PLANNED_KNOBS, activation_offload=False)
    rows = plan(resolve_model(model), gpu_spec(gpu), workload, knobs=knobs)
    return rows, micro_batch_options(workload)


class Draw(Protocol):
    """Where a study's choices come from: hypothesis (the property test) or a seeded
    ``random.Random`` (the test that the property test reaches every branch)."""

    def integer(self, low: int, high: int) -> int: ...
    def real(self, low: float, high: float) -> float: ...
    def pick(self, options: Sequence[T]) -> T: ...


class _Hypothesis:
    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def real(self, low: float, high: float) -> float:
        return self.draw(st.floats(low, high))

    def pick(self, options: Sequence[T]) -> T:
        return self.draw(st.sampled_from(options))


class _Seeded:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def real(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def pick(self, options: Sequence[T]) -> T:
        return self.rng.choice(list(options))


def build_study(draw: Draw) -> tuple[int, list[Measurement]]:
    """A workload and a study of it, of one of two kinds:

    - open: some configurations measured at some sizes below their first out-of-memory size
      (if any; the whole per-rank batch, which keeps no gradients between micro-steps, out of
      memory too or not), each measured/predicted ratio drawn in 0.6-1.4 (so the bound keeps some
      configurations open), some trials failed, interrupted or running elsewhere;
    - finished: every configuration measured up to its limit at speeds drawn close together
      (so only near-ties are left), at most one point re-measured so far; or, settled, at
      speeds 10-20 % below one point measured twice (the best, confirmed: nothing is left).
    """
    index = draw.integer(0, len(WORKLOADS) - 1)
    rows, sizes = _space(index)
    finished = draw.pick([False, True])
    if finished:
        chosen = list(range(len(rows)))
    else:
        count = draw.integer(0, len(rows))
        chosen = sorted({draw.integer(0, len(rows) - 1) for _ in range(count)})
    low = draw.real(1e3, 1e5)
    repeated = draw.integer(0, 3)  # finished studies: how many points were re-measured
    settled = finished and draw.pick([False, True])
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
        oom_at = draw.pick([None, *range(len(sizes))])
        below = sizes if oom_at is None else sizes[:oom_at]
        measured = list(below)
        if not finished and below and draw.pick([False, True]):
            measured = sorted({draw.pick(below) for _ in range(draw.integer(0, len(below)))})
        ratio = draw.real(0.6, 1.4)
        for mbs in measured:
            if settled:
                value, repeats = draw.real(low * 0.8, low * 0.9), 1
            elif finished:
                value = draw.real(low, low * 1.05)
                repeats = 1
                if repeated and draw.integer(0, 3) == 0:
                    repeated, repeats = repeated - 1, 2
            else:
                value = (row.speeds.get(mbs) or low) * ratio
                repeats = draw.pick([1, 1, 1, 2, 3])
            peak = int(row.peak_at(mbs) * draw.real(0.7, 1.0))
            for repeat in range(repeats):
                add(config, mbs, "COMPLETE", "ok", value=value, peak_bytes=peak, repeat=repeat)
        if oom_at is not None:
            add(config, sizes[oom_at], "COMPLETE", "oom", value=0.0)
            # The whole per-rank batch (one micro-step, no gradients kept) is open after an
            # OOM of a size that accumulates: measured out of memory too, or not yet.
            if oom_at < len(sizes) - 1 and (finished or draw.pick([False, True])):
                add(config, sizes[-1], "COMPLETE", "oom", value=0.0)
        extra = draw.pick([None, None, "error", "interrupted", "running"])
        free = [m for m in below if m not in {x.micro_batch_size for x in measurements
                                              if x.config == config}]  # fmt: skip
        if extra is not None and free:
            mbs = draw.pick(free)
            if extra == "running":
                add(config, mbs, "RUNNING", None, value=None)
            else:
                add(config, mbs, "FAIL", extra, value=None)
    first = next((i for i, m in enumerate(measurements) if m.outcome == "ok"), None)
    if settled and first is not None:  # the best, ahead of the rest and measured twice
        best = dataclasses.replace(measurements[first], value=low)
        measurements[first] = best
        add(best.config, best.micro_batch_size, "COMPLETE", "ok", value=low * 1.01,
            peak_bytes=best.peak_bytes, repeat=1)  # fmt: skip
    return index, measurements


@st.composite
def studies(draw: st.DrawFn) -> tuple[int, list[Measurement]]:
    return build_study(_Hypothesis(draw))


def _kind(proposal: Proposal | None) -> str:
    return "none" if proposal is None else "re-measure" if proposal.repeat else "first"


def test_the_generated_studies_reach_every_branch_of_the_search() -> None:
    """The property below is only as good as the studies it sees: on 150 seeded studies of the
    same generator, the search proposes first measurements, re-measurements of near-ties and
    nothing (a finished study), each in a good share of them."""
    kinds = Counter(
        _kind(propose(_space(index)[0], measurements, _space(index)[1]))
        for index, measurements in (build_study(_Seeded(seed)) for seed in range(150))
    )
    print(dict(kinds))
    assert kinds["first"] >= 45 and kinds["re-measure"] >= 25 and kinds["none"] >= 15, kinds


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

    def accumulation(mbs: int) -> int:  # the largest size is the whole per-rank batch
        return 1 if mbs == sizes[-1] else 2

    for mbs in proposal.micro_batch_sizes:  # an OOM rules out the larger sizes alike
        assert not any(oom_rules_out(o, mbs, accumulation) for o in ooms), (
            ooms,
            mbs,
            sizes,
            proposal,
        )
    assert not any(m.state == "RUNNING" for m in mine), "a configuration running elsewhere"
    assert not any(m.outcome == "error" for m in mine), "a configuration that failed for good"
    assert list(proposal.micro_batch_sizes) == sorted(set(proposal.micro_batch_sizes))
    assert set(proposal.micro_batch_sizes) <= set(sizes)
    runs: dict[int, int] = defaultdict(int)
    for m in mine:
        if m.outcome == "ok":
            runs[m.micro_batch_size] += 1
    # Each size a first measurement, or the next of a measured point: one point a probe,
    # alone or riding along with new sizes of its configuration.
    repeats = proposal.repeats()
    measured = {m.micro_batch_size for m in mine if m.outcome != "interrupted"}
    again = [mbs for mbs, repeat in repeats.items() if repeat]
    assert len(again) <= 1 and (len(repeats) == 1 or again == [proposal.riding] or not again)
    for mbs, repeat in repeats.items():
        if repeat:
            assert runs[mbs] == repeat, (proposal, mine)
        else:
            assert mbs not in measured, (proposal, mine)

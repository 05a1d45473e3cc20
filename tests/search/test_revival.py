"""A knob the planner leaves out (its twin without it is predicted to fit as large a
micro-batch) comes back into the search once that twin runs out of memory where it was
predicted to fit: the prediction that made the knob pointless was wrong there."""

from __future__ import annotations

from autotune.config import Optimizer, TrainConfig
from autotune.estimator.plan import PlanRow, plan
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.search.ladder import propose, revived
from autotune.space import Workload, micro_batch_options
from autotune.study.measurement import Measurement

WORK = Workload(seq_len=2048, global_batch=64, world_size=1)
TWIN = TrainConfig()
KNOB = TrainConfig(optimizer=Optimizer.ADAMW_8BIT)


def _rows(planned_out: bool) -> list[PlanRow]:
    return plan(resolve_model("qwen2.5-1.5b"), gpu_spec("h100-80gb"), WORK, planned_out=planned_out)


def test_the_plan_lists_what_it_leaves_out_last_with_its_twin() -> None:
    """qwen2.5-1.5b on one H100: 8-bit AdamW without checkpointing fits micro-batch 4, as fused
    AdamW does, so the plan leaves it out; with ``planned_out`` it is listed after every kept
    row, naming that twin; the kept rows are the plan's, in its order."""
    kept, every = _rows(False), _rows(True)
    assert every[: len(kept)] == kept
    left_out = every[len(kept) :]
    assert left_out and all(r.twin is not None for r in left_out)
    assert all(r.twin is None for r in kept)
    [row] = [r for r in left_out if r.config == KNOB]
    assert row.twin == TWIN
    assert KNOB not in {r.config for r in kept}


def _measured(config: TrainConfig, outcomes: dict[int, str]) -> list[Measurement]:
    return [
        Measurement(
            number=i, config=config, micro_batch_size=mbs, state="COMPLETE", outcome=outcome,
            feasible=outcome == "ok", value=30_000.0 if outcome == "ok" else None,
            peak_bytes=1,
        )
        for i, (mbs, outcome) in enumerate(outcomes.items())
    ]  # fmt: skip


def test_a_left_out_knob_is_tried_once_its_twin_runs_out_where_predicted_to_fit() -> None:
    """On the twin and the left-out row alone: the search proposes the twin first, never the
    row while the twin's measurements bear the prediction out (micro-batch 4 fits), and the
    row once the twin runs out of memory at 4, a size the row is predicted to fit."""
    rows = {r.config: r for r in _rows(True)}
    pair = [rows[TWIN], rows[KNOB]]
    sizes = micro_batch_options(WORK)
    first = propose(pair, [], sizes)
    assert first is not None and first.config == TWIN
    held = _measured(TWIN, {2: "ok", 4: "ok", 8: "oom"})
    assert not revived(rows[KNOB], None)
    after_held = propose(pair, held, sizes)
    assert after_held is None or after_held.config == TWIN
    broke = _measured(TWIN, {2: "ok", 4: "oom"})
    nxt = propose(pair, broke, sizes)
    assert nxt is not None and nxt.config == KNOB and 4 in nxt.micro_batch_sizes
    assert "single ac:off ran out of memory where predicted to fit" in nxt.reason

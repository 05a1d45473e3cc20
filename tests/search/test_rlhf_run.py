"""``run --rlhf``: the search over an RL iteration's layouts, with real probes on the CPU.

PPO of the tiny llama (policy, reference, critic, reward: four models on one rank) under a
52 MiB emulated device, the engine awake through training (``--no-sleep``, as in the founding
case) and the frozen models on the device (``--frozen gpu``), one sequence of 256 tokens an
iteration. Equally fast layouts go larger share first; the estimator's prior error lets 0.9
be tried (predicted just over), and reality agrees it
does not fit: the probe runs out of memory for real, the OOM is a trial, and the search moves
to 0.8, which fits. A rerun finds both in the study and probes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from autotune import api
from autotune.cli import app
from autotune.config import TrainConfig
from autotune.estimator.rlhf import RLHFRow, plan_rlhf
from autotune.hardware import cpu_device_spec
from autotune.models import resolve_model
from autotune.search.rlhf import may_fit, propose
from autotune.study.rlhf import RLHFTrial
from autotune.tuned.rlhf import Algorithm, Placement, RLHFModels, RLHFWorkload

CAP = 52 * 1024**2
ARGS = dict(
    device="cpu",
    device_memory=CAP,
    seq_len=256,
    rollout_batch=1,
    sleep=False,
    frozen="gpu",
    budget="5m",
)


def rows(shares: tuple[float, ...] = (0.5, 0.8, 0.9)) -> list:
    tiny = resolve_model("tiny")
    work = RLHFWorkload(
        algorithm=Algorithm.PPO,
        models=RLHFModels(policy=tiny, reference=tiny, critic=tiny, reward=tiny),
        seq_len=256,
        response_len=128,
        rollout_batch=1,
        world_size=1,
    )
    return plan_rlhf(
        work,
        cpu_device_spec(CAP),
        shares=shares,
        sleeps=(False,),
        placements=(Placement.RESIDENT,),
        engines=None,
        offload=False,
        reserve=0,
    )


def test_the_search_tries_the_largest_share_that_may_fit_then_the_one_that_fits(
    tmp_path: Path,
) -> None:
    planned = {(r.share, r.config): r for r in rows()}
    single = TrainConfig()
    assert not planned[(0.9, single)].fits and may_fit(planned[(0.9, single)])
    assert planned[(0.8, single)].fits

    storage = f"sqlite:///{tmp_path}/t.db"
    summary = api.tune_rlhf("ppo", "tiny", storage=storage, trials_dir=tmp_path / "trials", **ARGS)
    first, second = summary.trials
    assert (first.share, first.outcome, first.feasible) == (0.9, "oom", False)
    assert first.samples_per_second == 0 and first.stage in ("forward", "backward", "optimizer")
    # Really out of memory: the probe's own report says the emulated device ran out.
    result = json.loads((Path(first.probe_dir) / "result.json").read_text())
    assert "emulated device out of memory" in result["sizes"][0]["message"]
    assert (second.share, second.outcome) == (0.8, "ok")
    assert second.samples_per_second > 0
    assert set(second.phases) == {"rollout", "scoring", "training"}
    assert max(second.phases.values()) <= CAP
    assert summary.probes == 2 and summary.best == second
    assert summary.stop_reason.startswith("search done")

    # A rerun reads both probes back and probes nothing; the command line says the same.
    command = [
        "run",
        "--rlhf",
        "ppo",
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--device-memory",
        "52MiB",
        "--seq-len",
        "256",
        "--rollout-batch",
        "1",
        "--no-sleep",
        "--frozen",
        "gpu",
        "--json",
    ]
    again = CliRunner().invoke(
        app, [*command, "--storage", storage, "--trials-dir", str(tmp_path / "trials")]
    )
    assert again.exit_code == 0, again.output
    found = json.loads(again.stdout)
    assert found["probes"] == 0 and found["study"] == summary.study
    assert [t["rollout_share"] for t in found["trials"]] == [0.9, 0.8]
    assert found["best"]["rollout_share"] == 0.8


def test_an_oom_rules_out_the_same_layout_at_larger_shares() -> None:
    """Pure: after an OOM at 0.8, neither 0.8 nor 0.9 of that layout is proposed again."""
    planned = rows()
    layout = next(r for r in planned if r.share == 0.8 and r.config == TrainConfig())
    oom = RLHFTrial(
        config=layout.config,
        share=0.8,
        sleep=False,
        micro_batch_size=layout.micro_batch_size,
        outcome="oom",
        samples_per_second=0.0,
    )
    proposed = propose(planned, [oom])
    assert proposed is not None
    assert not (proposed.config == layout.config and proposed.share >= 0.8)


def measured(row: RLHFRow, speed: float) -> RLHFTrial:
    """A probe of ``row``'s layout that fitted at ``speed`` samples a second."""
    return RLHFTrial(
        config=row.config,
        share=row.share,
        sleep=row.sleep,
        micro_batch_size=row.micro_batch_size,
        outcome="ok",
        samples_per_second=speed,
    )


def test_the_search_stops_when_nothing_left_can_beat_the_best() -> None:
    """Pure: a measured layout as fast as every remaining prediction ends the search."""
    planned = rows((0.5, 0.8))
    fastest = max(planned, key=lambda r: r.speed)
    assert propose(planned, [measured(fastest, fastest.speed)]) is None
    # Before any probe: the fastest that may fit, the larger share of equally fast ones.
    first = propose(planned, [])
    assert first is not None and may_fit(first)
    assert all(
        (round(first.speed, 6), first.share) >= (round(r.speed, 6), r.share)
        for r in planned
        if may_fit(r)
    )


def test_a_layout_predicted_as_fast_as_the_best_never_extends_the_search() -> None:
    """Pure: whatever speed the best measured, the layouts predicted exactly as fast (the same
    layout at another share) are scaled to that speed and cannot beat it, however the ratio
    rounds (a measured speed times prediction over prediction lands a rounding above it for
    about one speed in thirty)."""
    planned = rows((0.5, 0.8))
    fastest = max(planned, key=lambda r: (r.speed, r.share))
    for step in range(1, 400):
        speed = 0.5 + step / 137
        assert propose(planned, [measured(fastest, speed)]) is None, speed


def test_a_run_without_a_fitting_layout_gives_memory_advice_only_after_an_oom() -> None:
    """The last line of ``run --rlhf`` without a best: lower the share where a probe ran out
    of memory; where every probe timed out or failed, how many, and where their logs are."""
    from autotune.search.rlhf import RLHFSummary

    def trial(outcome: str) -> RLHFTrial:
        return RLHFTrial(
            config=TrainConfig(), share=0.5, sleep=False, micro_batch_size=1, outcome=outcome,
            samples_per_second=0.0,
        )  # fmt: skip

    def said(*outcomes: str) -> str | None:
        trials = [trial(o) for o in outcomes]
        return RLHFSummary(
            study="s", trials=trials, probes=len(trials), stop_reason="x", best=None
        ).why_no_best

    assert said("oom", "timeout") == "no layout fitted: lower --rollout-share, or let --sleep"
    assert said("timeout", "timeout", "error") == (
        "no layout was measured to fit or not (2 timeout, 1 error): each probe's log, in its "
        "folder under --trials-dir, says why"
    )

"""The RLHF planner: each phase's memory of a PPO or GRPO iteration with a colocated rollout
engine, the founding case (Qwen2.5-1.5B PPO on 4 x A100 80GB, ZeRO-3, sequence 1k, whose
rollout engine at vLLM's default share of 0.9 left the trainer no room), and the share a
layout fits at.

The engine's figures (its workspace, graphs, the rollout's efficiencies) are assumptions
(docs/rlhf.md): these tests check the planner's arithmetic and verdicts, which follow from
the trainer's memory model (fitted on H100 probes, docs/estimator.md) and the GPU's size, not
the rollout's speed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autotune import api
from autotune.cli import app
from autotune.config import ConfigError, Engine, TrainConfig
from autotune.estimator.memory import state_layout
from autotune.estimator.rlhf import (
    ENGINE_ASLEEP_BYTES,
    KV_BLOCK_TOKENS,
    engine_estimate,
    kv_bytes_per_token,
)
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.tuned.rlhf import Placement

CASE = (
    "plan", "--rlhf", "ppo", "--model", "qwen2.5-1.5b", "--gpu", "a100-80gb", "--gpus", "4",
    "--seq-len", "1024", "--json",
)  # fmt: skip
GiB = 1024**3


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_founding_case_does_not_fit_at_vllms_default_share_and_says_why() -> None:
    """At 0.9 no layout of the case's trainer (DeepSpeed ZeRO, no trainer offload) fits: the
    engine's 72 GiB and the two trained models' ZeRO-3 states already pass the A100's memory
    during the rollout; the plan names that phase, by how much, and the largest share that
    fits."""
    found = plan_json(*CASE, "--rollout-share", "0.9")
    assert found["rlhf"] == "ppo" and not found["fits"]
    assert found["models"] == dict.fromkeys(
        ("policy", "reference", "critic", "reward"), "qwen2.5-1.5b"
    )
    best = found["rows"][0]
    assert best["config"]["engine"] == "deepspeed" and best["config"]["zero_stage"] == 3
    assert best["rollout_share"] == 0.9 and not best["fits"]
    assert set(best["over_bytes"]) == {"rollout"}  # sleeping and offloaded frozen models
    over = best["over_bytes"]["rollout"]
    assert 1 * GiB < over < 16 * GiB
    assert (
        best["miss"].startswith("rollout: ") and " over; fits at --rollout-share 0." in best["miss"]
    )
    # The engine claims 0.9 of the card; the policy's and critic's ZeRO-3 states beside it.
    engine = best["parts"]["rollout"]["engine"]
    assert engine == int(0.9 * 80 * GiB)
    model = resolve_model("qwen2.5-1.5b")
    assert 0.5 < best["max_share"] < 0.9
    policy = state_layout(model, TrainConfig.from_dict(best["config"]), 4)
    states = policy.parameters + policy.optimizer + policy.resident_buffers
    assert best["parts"]["rollout"]["trained states"] == 2 * int(states)
    # Every row misses, each naming a phase.
    assert all(not r["fits"] and r["miss"] for r in found["rows"])


def test_the_founding_case_fits_at_half_the_gpu() -> None:
    """The case's cure: ``gpu_memory_utilization=0.5``."""
    found = plan_json(*CASE, "--rollout-share", "0.5")
    assert found["fits"]
    best = found["rows"][0]
    assert best["fits"] and best["rollout_share"] == 0.5 and best["samples_per_second"] > 0
    assert all(used <= best["capacity_bytes"] for used in best["phases"].values())
    # A share of 0.5 leaves room for about a thousand 1k-token sequences' KV cache.
    assert 500 < best["engine"]["sequences_at_once"] < 2000


def test_the_largest_share_a_layout_fits_at_is_the_edge() -> None:
    """``max_share`` of a layout that misses (shown at micro-batch 1, its smallest peak): at
    that share the layout fits, one hundredth above it does not."""
    found = api.plan_rlhf(
        "ppo", "qwen2.5-1.5b", gpu="a100-80gb", gpus=4, seq_len=1024, rollout_share=0.9
    )
    checked = 0
    for row in found.rows[:6]:
        assert row.max_share is not None and row.micro_batch_size == 1
        for share, fits in ((row.max_share, True), (row.max_share + 0.01, False)):
            again = api.plan_rlhf(
                "ppo",
                "qwen2.5-1.5b",
                gpu="a100-80gb",
                gpus=4,
                seq_len=1024,
                rollout_share=round(share, 2),
                sleep=row.sleep,
                frozen=row.frozen.value,
                engines=[row.config.engine],
            )
            (same,) = [r for r in again.rows if r.config == row.config]
            assert same.fits is fits, (row.config.label(), share, same.miss)
        checked += 1
    assert checked == 6


def test_sleep_frees_the_share_for_scoring_and_training_and_costs_a_copy() -> None:
    """An engine asleep keeps only its graphs; moving its weights out and back costs time."""
    found = api.plan_rlhf(
        "grpo", "qwen2.5-1.5b", gpu="h100", gpus=8, seq_len=2048, rollout_share=0.6, frozen="gpu"
    )
    pairs: dict[tuple, dict[bool, object]] = {}
    for row in found.rows:
        pairs.setdefault((row.config, row.micro_batch_size), {})[row.sleep] = row
    compared = 0
    for both in pairs.values():
        if len(both) < 2:
            continue
        awake, asleep = both[False], both[True]
        freed = awake.engine.share_bytes - ENGINE_ASLEEP_BYTES
        for phase in ("scoring", "training"):
            assert awake.phases[phase] - asleep.phases[phase] == freed
        assert awake.phases["rollout"] == asleep.phases["rollout"]
        assert asleep.seconds["switch"] > awake.seconds["switch"] == 0.0
        compared += 1
    assert compared >= 4


def test_frozen_models_on_the_host_leave_the_rollout_and_training_but_cost_a_load() -> None:
    found = api.plan_rlhf(
        "ppo", "qwen2.5-1.5b", gpu="a100-80gb", gpus=4, seq_len=1024, rollout_share=0.5
    )
    rows = {(r.config, r.sleep, r.frozen): r for r in found.rows}
    for (config, sleep, place), row in rows.items():
        if place is not Placement.OFFLOAD:
            continue
        resident = rows[(config, sleep, Placement.RESIDENT)]
        if resident.micro_batch_size != row.micro_batch_size:
            continue
        frozen = resident.parts["training"]["frozen"]
        assert frozen > 0 and row.parts["training"]["frozen"] == 0
        assert resident.phases["rollout"] - row.phases["rollout"] == frozen
        assert row.seconds["switch"] > resident.seconds["switch"]


def test_the_kv_cache_a_share_buys() -> None:
    """Qwen2.5-1.5B: 28 layers x 2 key-value heads x 128 x (key, value) x 2 bytes = 28 KiB a
    token; a sequence takes whole 16-token blocks; the cache is the share less the weights and
    the workspace."""
    model = resolve_model("qwen2.5-1.5b")
    assert kv_bytes_per_token(model) == 28 * 2 * 128 * 2 * 2 == 28672
    gpu = gpu_spec("a100-80gb")
    small, large = (engine_estimate(model, gpu, s, 1000) for s in (0.3, 0.6))
    assert small.sequence_kv_bytes == 1008 * 28672 and 1008 % KV_BLOCK_TOKENS == 0
    assert small.weight_bytes == 2 * model.num_params
    assert large.kv_bytes - small.kv_bytes == large.share_bytes - small.share_bytes
    assert large.sequences > 1.9 * small.sequences > 0
    # Too small a share holds the weights but no sequence: the engine cannot start.
    tiny = engine_estimate(model, gpu, 0.05, 1000)
    assert not tiny.starts


def test_a_rollout_bound_by_the_cache_speeds_up_with_the_share() -> None:
    """Where a GPU's sequences do not all fit the cache at once, a larger share decodes them in
    fewer waves: the rollout phase shortens."""
    found = api.plan_rlhf(
        "grpo",
        "llama-7b",
        gpu="h100",
        gpus=8,
        seq_len=4096,
        rollout_batch=1024,
        reward="none",
        rollout_share="0.4,0.8",
        sleep=True,
        engines=[Engine.DEEPSPEED],
        offload=True,
    )
    by_share = {row.share: row for row in found.rows}
    low, high = by_share[0.4], by_share[0.8]
    assert low.engine.sequences < 128  # of the 128 a GPU generates: more than one wave
    assert high.seconds["rollout"] < low.seconds["rollout"]


def test_grpo_without_reward_model_has_policy_and_reference_alone() -> None:
    found = api.plan_rlhf("grpo", "qwen2.5-1.5b", gpu="h100", gpus=2, reward="none")
    assert found.to_dict()["models"] == {
        "policy": "qwen2.5-1.5b",
        "reference": "qwen2.5-1.5b",
        "critic": None,
        "reward": None,
    }
    best = found.rows[0]
    assert best.fits
    # One trained model: the training peak is the policy's own.
    assert best.parts["training"]["training"] == best.training.device_bytes


def test_bad_models_are_refused_in_the_library_too() -> None:
    with pytest.raises(ConfigError, match="GRPO has no critic"):
        api.plan_rlhf("grpo", "qwen2.5-1.5b", gpu="h100", gpus=2, critic="qwen2.5-1.5b")
    with pytest.raises(ConfigError, match="vocabulary"):
        api.plan_rlhf("ppo", "qwen2.5-1.5b", gpu="h100", gpus=2, reference="llama-7b")

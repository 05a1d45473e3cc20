"""Tests for ProbeSpec (validation, round trip) and ProbeResult / merge_sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autotune.config import ConfigError, Engine, Offload, Precision, TrainConfig
from autotune.probe.outcome import Classification, Outcome, Stage
from autotune.probe.result import ProbeResult, SizeResult, merge_sizes
from autotune.probe.spec import ProbeSpec

# --- ProbeSpec ---------------------------------------------------------------------------------


def test_spec_defaults() -> None:
    """Defaults: one process, one size, the default config."""
    spec = ProbeSpec(model="tiny")
    assert spec.config == TrainConfig()
    assert spec.micro_batch_sizes == (1,)
    assert spec.num_processes == 1
    assert spec.device_memory_bytes is None
    assert spec.tokens_per_micro_step == 2048


def test_spec_coerces_sizes_and_config_dict() -> None:
    """A list of sizes becomes a tuple; a config dict becomes a validated TrainConfig."""
    spec = ProbeSpec(
        model="tiny",
        config={"engine": "deepspeed", "zero_stage": 3, "offload": "params"},  # type: ignore[arg-type]
        micro_batch_sizes=[8, 4],  # type: ignore[arg-type]
        seq_len=128,
        num_processes=2,
    )
    assert spec.micro_batch_sizes == (8, 4)
    assert spec.config == TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.PARAMS)
    assert spec.tokens_per_micro_step == 8 * 128


def test_spec_config_dict_is_validated() -> None:
    """An invalid config dict inside a spec is a ConfigError."""
    with pytest.raises(ConfigError, match="--"):
        ProbeSpec(model="tiny", config={"engine": "ddp", "offload": "params"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"micro_batch_sizes": ()}, "micro-batch"),
        ({"micro_batch_sizes": (4, 0)}, "micro-batch"),
        ({"micro_batch_sizes": (-1,)}, "micro-batch"),
        ({"seq_len": 0}, "seq-len"),
        ({"grad_accum": 0}, "grad-accum"),
        ({"num_processes": 0}, "num-processes"),
        ({"timed_steps": 0}, "timed-steps"),
        ({"warmup_steps": -1}, "warmup-steps"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"num_processes": 2}, "engine single runs one process"),
        ({"device_memory_bytes": 0}, "--device-memory"),
        ({"device_memory_bytes": -5}, "--device-memory"),
        ({"timeout_s": 0}, "timeout"),
        ({"timeout_s": -1.0}, "timeout"),
        (
            {
                "device": "cpu",
                "config": TrainConfig(engine=Engine.DEEPSPEED, precision=Precision.FP16_MIXED),
            },
            "--precision bf16-mixed",
        ),
    ],
    ids=lambda v: (
        ",".join(f"{k}={x}" for k, x in v.items() if k != "config") + ",ds-fp16" * ("config" in v)
        if isinstance(v, dict)
        else "msg"
    ),
)
def test_spec_rejects(overrides: dict[str, Any], needle: str) -> None:
    """Each invalid field is a ConfigError whose message says which and what to do."""
    with pytest.raises(ConfigError) as caught:
        ProbeSpec(model="tiny", **overrides)
    assert needle in str(caught.value)


def test_spec_accepts_edge_values() -> None:
    """Zero warm-up steps, several ranks of a distributed engine, DeepSpeed fp16 on a GPU."""
    spec = ProbeSpec(
        model="tiny",
        config=TrainConfig(engine=Engine.DDP),
        num_processes=4,
        warmup_steps=0,
        device="cuda",
    )
    assert spec.num_processes == 4
    assert spec.warmup_steps == 0
    fp16 = TrainConfig(engine=Engine.DEEPSPEED, precision=Precision.FP16_MIXED)
    assert ProbeSpec(model="tiny", config=fp16, device="cuda").config == fp16


def test_spec_round_trip_through_json() -> None:
    """to_dict is JSON-able and from_dict(json) gives an equal spec."""
    spec = ProbeSpec(
        model="tiny-qwen",
        config=TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=2, offload=Offload.PARAMS),
        micro_batch_sizes=(8, 4, 2, 1),
        seq_len=64,
        grad_accum=2,
        num_processes=2,
        device="cpu",
        device_memory_bytes=123_456_789,
        warmup_steps=0,
        timed_steps=5,
        timeout_s=30.5,
        seed=7,
        lr=3e-4,
    )
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["config"]["engine"] == "fsdp"
    assert data["micro_batch_sizes"] == [8, 4, 2, 1]
    assert ProbeSpec.from_dict(data) == spec


def test_spec_from_dict_ignores_unknown_keys() -> None:
    """Keys written by newer versions are ignored."""
    data = ProbeSpec(model="tiny").to_dict() | {"added_later": 1}
    assert ProbeSpec.from_dict(data) == ProbeSpec(model="tiny")


# --- merge_sizes -------------------------------------------------------------------------------


def _size(mbs: int, outcome: str = "ok", **fields: Any) -> dict[str, Any]:
    return {"micro_batch_size": mbs, "outcome": outcome, **fields}


def _rank(*sizes: dict[str, Any]) -> dict[str, Any]:
    return {"status": "ok", "sizes": list(sizes)}


OK = Classification(outcome=Outcome.OK)
Reports = list[dict[str, Any] | None]


def test_merge_memory_is_max_over_ranks_throughput_from_rank0() -> None:
    """Peak memory is the worst rank's; throughput and losses are rank 0's."""
    reports: Reports = [
        _rank(
            _size(
                4,
                tokens_per_second=1000.0,
                losses=[2.0, 1.0],
                peak_allocated_bytes=100,
                peak_reserved_bytes=300,
                host_rss_bytes=50,
                nvml_used_bytes=None,
            )
        ),
        _rank(
            _size(
                4,
                tokens_per_second=999.0,
                losses=[2.1, 1.1],
                peak_allocated_bytes=200,
                peak_reserved_bytes=250,
                host_rss_bytes=70,
                nvml_used_bytes=None,
            )
        ),
    ]
    [merged] = merge_sizes(reports, 2, OK)
    assert merged.micro_batch_size == 4
    assert merged.outcome == "ok"
    assert merged.tokens_per_second == 1000.0
    assert merged.losses == (2.0, 1.0)
    assert merged.peak_allocated_bytes == 200
    assert merged.peak_reserved_bytes == 300
    assert merged.host_rss_bytes == 70
    assert merged.nvml_used_bytes is None
    assert reports[0] is not None
    assert reports[0]["sizes"][0]["peak_allocated_bytes"] == 100  # inputs are not modified


def test_merge_keeps_size_order_and_every_size() -> None:
    """One entry per size, in the order the sizes were run."""
    reports: Reports = [_rank(_size(8, "oom"), _size(4), _size(2))]
    merged = merge_sizes(reports, 1, OK)
    assert [m.micro_batch_size for m in merged] == [8, 4, 2]
    assert [m.outcome for m in merged] == ["oom", "ok", "ok"]


def test_merge_worst_outcome_with_its_stage_and_message() -> None:
    """If any rank ran out of memory at a size, the size is oom with that rank's stage."""
    reports: Reports = [
        _rank(_size(4, "error", stage="backward", message="Connection closed by peer")),
        _rank(_size(4, "oom", stage="forward", message="OutOfMemoryError: emulated")),
    ]
    oom = Classification(outcome=Outcome.OOM, stage=Stage.FORWARD, message="x", rank=1)
    [merged] = merge_sizes(reports, 2, oom)
    assert merged.outcome == "oom"
    assert merged.stage == "forward"
    assert merged.message == "OutOfMemoryError: emulated"


def test_merge_error_beats_ok() -> None:
    """A rank whose loss was not finite makes the size an error."""
    reports: Reports = [_rank(_size(2)), _rank(_size(2, "error", message="loss is not finite"))]
    [merged] = merge_sizes(reports, 2, OK)
    assert merged.outcome == "error"
    assert merged.message == "loss is not finite"


def test_merge_missing_rank_takes_the_probe_outcome() -> None:
    """A size a rank never reported (it crashed) takes the probe's outcome and message."""
    crash = Classification(outcome=Outcome.CRASH, message="rank 1 died from SIGSEGV", rank=1)
    reports: Reports = [_rank(_size(2, peak_allocated_bytes=10)), None]
    [merged] = merge_sizes(reports, 2, crash)
    assert merged.outcome == "crash"
    assert merged.message == "rank 1 died from SIGSEGV"
    assert merged.peak_allocated_bytes == 10


def test_merge_missing_rank_keeps_a_worse_outcome() -> None:
    """A size already failed in the ranks that reported it keeps its own outcome."""
    timeout = Classification(outcome=Outcome.TIMEOUT, message="probe exceeded its time limit")
    reports: Reports = [_rank(_size(2, "oom", stage="backward", message="emulated")), _rank()]
    [merged] = merge_sizes(reports, 2, timeout)
    assert merged.outcome == "oom"
    assert merged.stage == "backward"


def test_merge_no_reports() -> None:
    """No rank reported anything: no sizes."""
    assert merge_sizes([None, None], 2, Classification(outcome=Outcome.HOST_OOM)) == []


# --- ProbeResult -------------------------------------------------------------------------------


def _result(tmp_path: Path) -> ProbeResult:
    spec = ProbeSpec(model="tiny", micro_batch_sizes=(8, 4, 2), device="cpu", seq_len=32)
    return ProbeResult(
        spec=spec,
        probe_dir=tmp_path,
        outcome=Outcome.OOM,
        stage=Stage.BACKWARD,
        message="OutOfMemoryError: emulated",
        failed_rank=0,
        sizes=[
            SizeResult.from_dict(entry)
            for entry in (
                _size(8, "oom", stage="backward"),
                _size(4, tokens_per_second=900.0),
                _size(2, tokens_per_second=600.0),
            )
        ],
        wall_s=5.5,
        import_s=2.0,
        build_s=0.5,
        device="cpu",
        num_params=1234,
        exits=[{"rank": 0, "pid": 4242, "returncode": 0, "killed_by_launcher": False}],
    )


def test_result_ok_sizes_and_size_lookup(tmp_path: Path) -> None:
    """ok_sizes drops failed sizes; size() finds one size's entry, or None."""
    result = _result(tmp_path)
    assert [s.micro_batch_size for s in result.ok_sizes()] == [4, 2]
    four = result.size(4)
    assert four is not None and four.tokens_per_second == 900.0 and four.ok
    assert result.size(16) is None
    eight = result.size(8)
    assert eight is not None and eight.outcome is Outcome.OOM and eight.stage is Stage.BACKWARD


def test_size_result_json_round_trip_keeps_unknown_keys() -> None:
    """A size entry survives to_dict/from_dict; NaN reads as None; unknown keys are kept."""
    data = {
        "micro_batch_size": 2, "outcome": "ok", "tokens_per_second": 10.0, "mfu": float("nan"),
        "peak_allocated_bytes": 5, "peak_reserved_bytes": 7, "losses": [1.5, 1.0],
        "future_field": {"x": 1},
    }  # fmt: skip
    size = SizeResult.from_dict(data)
    assert size.mfu is None and size.peak_bytes == 7 and size.losses == (1.5, 1.0)
    assert size.extra == {"future_field": {"x": 1}}
    again = SizeResult.from_dict(json.loads(json.dumps(size.to_dict())))
    assert again == size
    assert SizeResult.from_dict({"micro_batch_size": 1, "outcome": "oom"}).peak_bytes is None


def test_result_write_read_round_trip(tmp_path: Path) -> None:
    """result.json written and read back gives the same result."""
    result = _result(tmp_path)
    path = result.write()
    assert path == tmp_path / "result.json"
    data = json.loads(path.read_text())
    assert data["outcome"] == "oom"
    assert data["stage"] == "backward"
    assert data["emulated_device_memory_bytes"] is None
    again = ProbeResult.read(tmp_path)
    assert again.spec == result.spec
    assert again.to_dict() == result.to_dict()

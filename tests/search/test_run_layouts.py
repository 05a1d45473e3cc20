"""``run --tp/--pp/--cp``: a search that keeps one layout, on the simulated GPU and with real
probes on the CPU.

The layout's degrees are fixed for the run; the search climbs its sharding and checkpointing
and bisects its micro-batches as it does for data parallelism, over the data-parallel ranks
that are left (the study's workload shares the global batch among them). A run that keeps a
layout is a study of its own (``/mp2``), so a data-parallel run at the same GPUs never mixes
its accumulation with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune import api
from autotune.api._tune import climb
from autotune.config import ConfigError
from autotune.estimator.plan import plan
from autotune.handoff.megatron import megatron_arguments
from autotune.hardware import gpu_spec
from autotune.layouts import LayoutOptions
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome
from autotune.space import Workload
from autotune.study.fingerprint import Fingerprint
from autotune.values import SEARCHED_KNOBS


def test_a_workload_under_a_layout_shares_its_batch_among_the_data_parallel_ranks() -> None:
    plain = Workload(seq_len=2048, global_batch=64, world_size=8)
    layout = Workload(seq_len=2048, global_batch=64, world_size=8, model_parallel=2)
    assert (plain.data_parallel, plain.per_rank_batch) == (8, 8)
    assert (layout.data_parallel, layout.per_rank_batch, layout.grad_accum(4)) == (4, 16, 4)
    with pytest.raises(ConfigError, match="not a multiple of 4 data-parallel ranks"):
        Workload(seq_len=2048, global_batch=10, world_size=8, model_parallel=2).check_splits()
    with pytest.raises(ConfigError, match="a layout of 3 ranks does not divide 8 GPUs"):
        Workload(seq_len=2048, global_batch=64, world_size=8, model_parallel=3)


def test_run_keeps_a_tensor_parallel_layout_on_the_simulated_gpu(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/t.db"
    common = dict(simulate="h100-80gb", gpus=8, budget="10m", storage=storage,
                  trials_dir=tmp_path / "trials")  # fmt: skip
    summary = api.tune("llama-7b", tp=2, **common)  # type: ignore[arg-type]
    assert summary.best is not None and summary.stop_reason.startswith("search done")
    assert summary.measurements and all(m.config.tp == 2 for m in summary.measurements)
    # The simulated GPU answers as the layout estimator predicts (its 2 % noise aside): the
    # best measured within 5 % of its planned row's prediction at that size.
    workload = Workload(seq_len=2048, global_batch=64, world_size=8, model_parallel=2)
    rows = plan(resolve_model("llama-7b"), gpu_spec("h100-80gb"), workload,
                layouts=LayoutOptions(tp=(2,), pp=(1,), cp=(1,)))  # fmt: skip
    [row] = [r for r in rows if r.config == summary.best.config]
    predicted = row.speeds[summary.best.micro_batch_size]
    assert abs(summary.best.value / predicted - 1) < 0.05, (summary.best.value, predicted)
    # A study of its own; a data-parallel run at the same GPUs is another.
    plain = api.tune("llama-7b", **common)  # type: ignore[arg-type]
    assert plain.best is not None and not plain.best.config.is_layout
    studies = [s.study_name for s in api.best(storage=storage)]
    assert len(studies) == 2 and sum("/mp2/" in name for name in studies) == 1
    # Exported as Megatron-LM runs it: a ZeRO-3 trial (Megatron's FSDP2 reshards), its
    # degrees and global batch as measured.
    zero3 = next(m for m in summary.measurements if m.config.zero_stage == 3 and m.feasible)
    found = api.export("megatron", storage=storage, study=next(s for s in studies if "/mp2/" in s),
                       trial=zero3.number)  # fmt: skip
    args = megatron_arguments(found.launch)
    assert args[args.index("--tensor-model-parallel-size") + 1] == "2"
    assert args[args.index("--global-batch-size") + 1] == "64"
    assert found.launch.grad_accum * found.launch.micro_batch_size * 4 == 64


def test_run_climbs_to_a_layout_where_no_data_parallel_configuration_fits(
    tmp_path: Path,
) -> None:
    """llama3.1-8b at 131,072 tokens on 8 simulated H100s, host memory too small to offload:
    no data-parallel configuration of the run's space fits (the plan says so), so the run
    searches under the plan's best layout that fits, says why, and a study of that layout holds
    the answer."""
    spec = resolve_model("llama3.1-8b")
    workload = Workload(seq_len=131072, global_batch=8, world_size=8)
    rows = plan(spec, gpu_spec("h100-80gb"), workload, host_memory_bytes=64 << 30,
                knobs=SEARCHED_KNOBS)  # fmt: skip
    assert rows and not any(row.fits for row in rows)
    # The plan ranks context parallelism first, which no probe runs yet: the climb takes the
    # first layout that fits and a probe can run.
    layouts = plan(spec, gpu_spec("h100-80gb"), workload, host_memory_bytes=64 << 30,
                   layouts=LayoutOptions())  # fmt: skip
    fitting = [row.config for row in layouts if row.config.is_layout and row.fits]
    assert fitting[0].cp > 1
    top = climb(layouts, 8, "llama3.1-8b")
    assert top is not None and top == next(c for c in fitting if c.cp == 1 and c.pp == 1)
    storage = f"sqlite:///{tmp_path}/t.db"
    tuning = api.prepare(
        "llama3.1-8b", simulate="h100-80gb", gpus=8, seq_len=131072, global_batch=8,
        host_memory="64GiB", budget="1h", storage=storage, trials_dir=tmp_path / "trials",
    )  # fmt: skip
    assert tuning.climbed is not None
    assert (
        "data-parallel configurations this run searches fits llama3.1-8b on 8 x" in tuning.climbed
    )
    degree = int(tuning.climbed.rsplit("--tp ", 1)[1].split()[0])
    assert degree > 1 and all(row.config.tp == degree for row in tuning.rows)
    summary = tuning.run()
    assert summary.best is not None and summary.best.config.tp == degree
    assert f"/mp{degree}/" in tuning.fingerprint.study_name


def test_a_data_parallel_study_stores_its_fingerprint_as_before() -> None:
    fingerprint = Fingerprint(model="tiny", seq_len=64, global_batch=8, gpu="cpu",
                              gpu_memory_bytes=1 << 20, gpus=2, device="cpu")  # fmt: skip
    assert "model_parallel" not in fingerprint.to_dict()
    assert "/mp" not in fingerprint.study_name
    layout = Fingerprint.from_dict({**fingerprint.to_dict(), "model_parallel": 2})
    assert layout.workload.data_parallel == 1 and "/mp2/" in layout.study_name


@pytest.mark.parametrize("degree", ["tp", "pp"])
def test_run_measures_a_layout_with_real_probes_on_the_cpu(tmp_path: Path, degree: str) -> None:
    """Two CPU ranks under an emulated device: every probe a real one of the layout (torch's
    DTensor plans under TP, its pipelining schedules under PP), each trial's result on disk."""
    summary = api.tune(
        "tiny", device="cpu", device_memory="8MiB", gpus=2, seq_len=64, global_batch=8,
        budget="4m", storage=f"sqlite:///{tmp_path}/t.db", trials_dir=tmp_path / "trials",
        warmup_steps=1, timed_steps=2, **{degree: 2},
    )  # fmt: skip
    assert summary.best is not None and getattr(summary.best.config, degree) == 2
    assert all(getattr(m.config, degree) == 2 for m in summary.measurements)
    for m in summary.measurements:
        assert m.probe_dir is not None
        result = json.loads((Path(m.probe_dir) / "result.json").read_text())
        assert result["device"] == "cpu" and result["outcome"] == Outcome.OK.value, result
        assert result["spec"]["config"][degree] == 2 and result["spec"]["num_processes"] == 2

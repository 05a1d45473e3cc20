"""LoRA as the search's last resort (``run --allow lora``): probed only once no full
fine-tuning configuration is left that may fit, and never the best while a full one fitted.

On simulated GPUs (the estimator, no error terms) and with real CPU probes of the tiny model
under an emulated device too small for any full fine-tuning of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import autotune

from autotune import api
from autotune.study.measurement import best_point


def _tune(tmp_path: Path, host_memory: str, lora_rank: int | None) -> api.RunSummary:
    return api.tune(
        "llama-7b",
        simulate="rtx4090",
        gpus=1,
        global_batch=8,
        host_memory=host_memory,
        budget="2h",
        storage=f"sqlite:///{tmp_path}/{host_memory}-{lora_rank}.db",
        trials_dir=tmp_path / "trials",
        lora_rank=lora_rank,
    )


def test_lora_is_searched_only_where_full_fine_tuning_cannot_fit(tmp_path: Path) -> None:
    """llama-7b on one RTX 4090: with 64 GiB of host memory no full fine-tuning fits (the
    offloaded states need more), and the search falls back on LoRA; with 192 GiB, parameter
    offload fits and no LoRA configuration is probed, though LoRA is allowed and faster."""
    tight = _tune(tmp_path, "64GiB", 16)
    assert tight.best is not None and tight.best.config.is_lora, tight.best
    assert tight.best.config.lora_rank == 16
    roomy = _tune(tmp_path, "192GiB", 16)
    assert roomy.best is not None and not roomy.best.config.is_lora
    assert not [m for m in roomy.measurements if m.config.is_lora]
    # Not allowed: nothing fits 64 GiB at all.
    with pytest.raises(api.NothingFits):
        _tune(tmp_path, "64GiB", None)


def test_a_full_fine_tuning_point_is_the_best_before_any_lora_one(tmp_path: Path) -> None:
    """A study holding both (LoRA measured faster) names the full fine-tuning point best."""
    tight = _tune(tmp_path, "64GiB", 16)
    roomy = _tune(tmp_path, "192GiB", 16)
    assert tight.best is not None and roomy.best is not None
    both = [*tight.measurements, *roomy.measurements]
    fastest = max((m for m in both if m.feasible), key=lambda m: m.value or 0.0)
    assert fastest.config.is_lora  # LoRA does fewer FLOPs a token
    best = best_point(both)
    assert best is not None and not best.config.is_lora


def test_a_cpu_run_falls_back_on_lora_and_says_so(tmp_path: Path) -> None:
    """Real CPU probes: the tiny model under an emulated 1.5 MiB device, where full
    fine-tuning needs 2.1 MiB at the least: run --allow lora ends with a LoRA configuration,
    recorded as such; without --allow lora nothing fits (exit 1, one line that suggests
    it)."""
    common = ("--model", "tiny", "--device", "cpu", "--gpus", "1", "--device-memory", "1.5MiB",
              "--seq-len", "128", "--global-batch", "8", "--budget", "3m")  # fmt: skip
    refused = autotune("run", *common, cwd=tmp_path)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.strip().endswith("or --allow lora"), refused.stderr
    done = autotune("run", *common, "--allow", "lora", "--lora-rank", "4", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["best"]["config"]["lora_rank"] == 4, summary["best"]
    assert "lora:r4" in summary["best"]["label"]

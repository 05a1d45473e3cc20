"""The engine that trained a user's job, as the measurement layer sees it, for real on this
machine's CPU (gloo): a job that trains under another engine than the one autotune asked for
is refused with one line naming both, not recorded as the engine asked for; one that trains
under the engine asked for is measured, and says which wrapper it saw.

- A torchrun script that always wraps its model in DDP (as ``examples/train_torchrun.py``
  does over several ranks): probed as ``deepspeed z1`` or ``fsdp`` it is refused; as ``ddp``
  it is measured.
- A script that wraps its model as ``autotune.job_config().engine`` says is measured as that
  engine (FSDP2's ``fully_shard`` here; DeepSpeed's ``initialize`` in
  tests/probe/test_ops_lock.py); one that gives DeepSpeed another ZeRO stage than the one
  asked is refused naming both stages.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autotune.config import Engine, TrainConfig
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.outcome import Outcome
from autotune.study.measurement import OTHER_ENGINE
from tests.probe.test_script_flags import _autotune, _recorded
from tests.probe.test_userjob import one_probe

DDP_SEEN = "DDP (torch's DistributedDataParallel)"

ENGINE_SCRIPT = """
import argparse

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import autotune

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--engine", default=None, help="the script's own engine")
parser.add_argument("--zero-stage", type=int, default=None, help="the script's own stage")
args = parser.parse_args()
job = autotune.job_config()
engine = args.engine or job.engine
dist.init_process_group("gloo")
config = AutoConfig.from_pretrained(args.model)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)
if job.ac_every:  # the tiny model's two blocks: every block (its only pattern)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
if engine == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif engine == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
if engine == "deepspeed":
    import deepspeed

    ds = dict(job.deepspeed)
    if args.zero_stage is not None:
        ds["zero_optimization"] = {**ds["zero_optimization"], "stage": args.zero_stage}
    model, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds
    )
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
generator = torch.Generator().manual_seed(dist.get_rank())
for step in range(job.max_steps):
    for _ in range(job.grad_accum):
        ids = torch.randint(0, config.vocab_size, (job.micro_batch_size, job.seq_len),
                            generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        if engine == "deepspeed":
            model.backward(loss)
            model.step()
        else:
            (loss / job.grad_accum).backward()
    if engine != "deepspeed":
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
"""
"""A torchrun script that wraps its model as autotune asks, or as it says itself (``--engine``,
``--zero-stage``: an engine or DeepSpeed ZeRO stage of its own, over autotune's)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny model's config.json, as the script names its model."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    return folder


@pytest.fixture
def job_probe(tmp_path: Path, model_dir: Path, fork_server: ForkServer) -> Callable[..., Any]:
    """A probe of a job in a folder of its own, its ranks forked from the session's warm
    process; the job's arguments name the tiny model."""
    runs = iter(range(100))

    def probe(script: Path, args: list[str], config: TrainConfig, **fields: Any) -> Any:
        here = tmp_path / f"run{next(runs)}"
        here.mkdir()
        (here / "model").symlink_to(model_dir)
        given = ["--model", str(model_dir), *args]
        return one_probe(here, script, "torchrun", given, config=config, warm=fork_server, **fields)

    return probe


def test_a_ddp_script_probed_as_another_engine_is_refused_naming_both(
    tmp_path: Path, job_probe: Callable[..., Any]
) -> None:
    """A script that always wraps its model in DDP (as ``examples/train_torchrun.py`` does
    over several ranks) over 2 ranks: refused as ``deepspeed z1`` and as ``fsdp``, measured
    as ``ddp``."""
    script = tmp_path / "engines.py"
    script.write_text(ENGINE_SCRIPT)
    ddp = ["--engine", "ddp"]
    deepspeed = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1)
    result = job_probe(script, ddp, deepspeed, num_processes=2)
    assert result.outcome is Outcome.ERROR
    assert result.message.startswith(
        f"the job trained under {DDP_SEEN} where autotune asked for engine deepspeed at ZeRO "
        "stage 1: does it call deepspeed.initialize with config=autotune.job_config()."
        "deepspeed when autotune.job_config().engine is 'deepspeed'?"
    ), result.message
    fsdp = TrainConfig(engine=Engine.FSDP, zero_stage=3)
    result = job_probe(script, ddp, fsdp, num_processes=2)
    assert result.outcome is Outcome.ERROR
    assert result.message.startswith(
        f"the job trained under {DDP_SEEN} where autotune asked for engine fsdp: does it "
        "apply fully_shard"
    ), result.message
    result = job_probe(script, ddp, TrainConfig(engine=Engine.DDP), num_processes=2)
    assert result.outcome is Outcome.OK, result.message
    assert result.sizes[0].extra["wrapper"] == DDP_SEEN


def test_a_script_that_follows_the_engine_is_measured_and_its_own_zero_stage_refused(
    tmp_path: Path, job_probe: Callable[..., Any]
) -> None:
    script = tmp_path / "engines.py"
    script.write_text(ENGINE_SCRIPT)
    result = job_probe(script, [], TrainConfig(engine=Engine.FSDP, zero_stage=3))
    assert result.outcome is Outcome.OK, result.message
    assert result.sizes[0].extra["wrapper"] == "FSDP2 (fully_shard)"
    # DeepSpeed as asked is measured: tests/probe/test_ops_lock.py, the last test.
    deepspeed = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1)
    result = job_probe(script, ["--zero-stage", "2"], deepspeed)
    assert result.outcome is Outcome.ERROR
    assert result.message.startswith(
        "the job trained under DeepSpeed's engine at ZeRO stage 2 where autotune asked for "
        "engine deepspeed at ZeRO stage 1: "
    ), result.message


@pytest.mark.slow
def test_a_run_learns_that_the_job_always_shards_with_fsdp2_and_tunes_it_so(
    tmp_path: Path, model_dir: Path
) -> None:
    """A script that always wraps its model in FSDP2 (``--engine fsdp``, its own), tuned on one
    CPU rank: the first probe (one process asked) trains FSDP2, and the run learns it there,
    says so in one line, and searches FSDP2 alone (on one GPU too, as the job shards) to a best,
    exit 0; the probe is recorded as ``other_engine``. The next run of the study starts from
    it (its first line names the engine), and one whose ``--engine`` leaves FSDP out is
    refused with the ``--engine`` to give (exit 2)."""
    script = tmp_path / "engines.py"
    script.write_text(ENGINE_SCRIPT)

    def run(*options: str) -> subprocess.CompletedProcess[str]:
        return _autotune(
            *("run", "--script", str(script), "--framework", "torchrun"),
            *("--model", str(model_dir), "--gpus", "1", "--device", "cpu"),
            *("--device-memory", "64MiB", "--seq-len", "64", "--global-batch", "8"),
            *("--storage", f"sqlite:///{tmp_path}/study.db", "--trials-dir", str(tmp_path / "t")),
            *options,
            *("--", "--model", str(model_dir), "--engine", "fsdp"),
        )

    done = run("--budget", "3m", "--json")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["mistake"] is None and summary["best"]["config"]["engine"] == "fsdp"
    [learnt] = summary["learnt"]
    assert learnt.startswith(
        "your job trained under FSDP2 (fully_shard) where autotune asked for single ac:off: "
        "the search keeps to fsdp"
    ), learnt
    assert learnt in done.stderr
    recorded = _recorded(tmp_path)
    other = [t for t in recorded if t["outcome"] == OTHER_ENGINE]
    assert [t["config"]["engine"] for t in other] == ["single"]
    assert all(t["config"]["engine"] == "fsdp" for t in recorded if t not in other)
    again = run("--budget", "1m")
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    first = " ".join(again.stdout.split())  # the terminal's wrapping undone
    assert "the engines it trains under when asked, as its probes found: fsdp)" in first
    refused = run("--budget", "1m", "--engine", "single")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the job trains under fsdp alone" in refused.stderr
    assert refused.stderr.rstrip().endswith("use --engine fsdp"), refused.stderr

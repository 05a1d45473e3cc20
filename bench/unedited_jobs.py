"""Training jobs written without autotune in mind, tuned and exported unedited, on this CPU.

Each job is a script of its framework with flags of its own for the micro-batch, the
accumulation and checkpointing, and imports nothing of autotune: a Hugging Face Trainer script
(examples/train_hf.py, one rank), a plain accelerate loop on one and on two CPU ranks
(examples/train_accelerate_plain.py) and a plain torchrun DDP loop on two ranks
(examples/train_torchrun_plain.py). For each: ``autotune run --script`` with no flag named
(the Trainer's are known, the others found in the script), ``autotune export --format
command``, the exported script run as a user runs it with the measurement layer reading it,
and the best point probed again just before it, back to back. The table: the command, whether
the first try worked, probes, the best, and the exported run's peak and tokens/s against the
probe's, beside the goals (peak within 2 %; tokens/s within noise, taken as 0.8-1.25x on a
shared 2-core machine).

    python bench/unedited_jobs.py [--budget 2m] [--only torchrun] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from autotune.config import TrainConfig
from autotune.models import resolve_model
from autotune.probe.metrics import throughput
from autotune.probe.outcome import Outcome
from autotune.probe.scriptprobe import launch_script_probe, run_measured
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import ScriptJob

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
SEQ = 64
GLOBAL_BATCH = 16
CAP = "64MiB"
PEAK_GOAL = 0.02
SPEED_GOAL = (0.8, 1.25)


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    script: Path
    framework: str
    ranks: int
    engine: str | None

    def args(self, model: Path, out: Path) -> list[str]:
        if self.framework == "hf":
            return [
                *("--model_name_or_path", str(model), "--output_dir", str(out)),
                *("--seq_len", str(SEQ), "--report_to", "none"),
                *("--per_device_train_batch_size", "64"),  # the user's own: replaced
            ]
        return ["--model", str(model), "--seq-len", str(SEQ), "--steps", "50"]


JOBS = [
    Job("Trainer, 1 rank", EXAMPLES / "train_hf.py", "hf", 1, None),
    Job("accelerate, 1 rank", EXAMPLES / "train_accelerate_plain.py", "accelerate", 1, None),
    Job("accelerate, 2 CPU ranks", EXAMPLES / "train_accelerate_plain.py", "accelerate", 2, "ddp"),
    Job("torchrun, 2 ranks", EXAMPLES / "train_torchrun_plain.py", "torchrun", 2, "ddp"),
]


def autotune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "autotune"), *args], capture_output=True, text=True, timeout=1800
    )


def measure(job: Job, budget: str, root: Path) -> dict[str, Any]:
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    storage = f"sqlite:///{root}/study.db"
    run = [
        *("run", "--script", str(job.script), "--framework", job.framework),
        *("--model", str(model), "--gpus", str(job.ranks), "--device", "cpu"),
        *("--device-memory", CAP, "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH)),
        *("--budget", budget, "--json", "--storage", storage, "--trials-dir", str(root / "t")),
        *(("--engine", job.engine) if job.engine else ()),
        "--",
        *job.args(model, root / "out"),
    ]
    done = autotune(*run)
    row: dict[str, Any] = {
        "job": job.name,
        "command": "autotune " + shlex.join(run).replace(str(root), "$DIR"),
        "first_try": done.returncode == 0,
    }
    if done.returncode != 0:
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
        return row
    summary = json.loads(done.stdout)
    best = summary["best"]
    row.update(probes=summary["probes"], best=f"{best['label']} mb {best['micro_batch_size']}")
    exported = root / "export"
    exported.mkdir()
    text = autotune(
        "export", "--format", "command", "--storage", storage, "--model", str(model), "--json"
    )
    if text.returncode != 0:
        row["error"] = f"the export: {text.stderr.strip()}"
        return row
    script = exported / "run.sh"
    script.write_text(json.loads(text.stdout)["text"])
    recognised = ScriptJob.read(
        job.script, job.framework, job.args(model, root / "out"), recognise=True
    )
    spec = ProbeSpec(
        model=str(model),
        script=recognised,
        config=TrainConfig.from_dict(best["config"]),
        micro_batch_sizes=(best["micro_batch_size"],),
        grad_accum=best["grad_accum"],
        seq_len=SEQ,
        num_processes=job.ranks,
        device="cpu",
    )
    # The same point probed again just before the exported run (back to back).
    probe = dataclasses.replace(spec, grad_accum=1, global_batch=GLOBAL_BATCH)
    probed = launch_script_probe(probe, root / "again")
    if probed.outcome is not Outcome.OK:
        row["error"] = f"the probe again: {probed.message}"
        return row
    (size,) = probed.sizes
    assert size.micro_step_s is not None and size.optimizer_step_s is not None
    probe_speed = throughput(
        micro_step_s=size.micro_step_s,
        optimizer_step_s=size.optimizer_step_s,
        micro_batch_size=spec.micro_batch_sizes[0],
        seq_len=SEQ,
        grad_accum=spec.grad_accum,
        world_size=spec.world_size,
        model_flops_per_token=1.0,
        hardware_flops_per_token=1.0,
        peak_flops=None,
    ).tokens_per_second
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    ran = run_measured(["sh", str(script)], spec, exported, env=env, timeout_s=900)
    if ran.returncode != 0 or ran.reports[0] is None:
        row["error"] = f"the export: {ran.stderr.strip().splitlines()[-1:]}"
        return row
    (entry,) = ran.reports[0]["sizes"]
    # The study's recorded peak (its probes accumulate as training does, up to 2 micro-steps).
    peak_probe = best.get("peak_bytes") or size.peak_allocated_bytes
    row.update(
        peak_ratio=entry["peak_allocated_bytes"] / peak_probe,
        speed_ratio=entry["tokens_per_second"] / probe_speed,
        exported_tokens_per_second=entry["tokens_per_second"],
        probe_tokens_per_second=probe_speed,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="2m")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="", help="the jobs whose name holds this text")
    options = parser.parse_args()
    rows = []
    for job in [j for j in JOBS if options.only in j.name]:
        with tempfile.TemporaryDirectory() as folder:
            rows.append(measure(job, options.budget, Path(folder)))
    if options.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"goals: exported peak within {PEAK_GOAL:.0%} of the probe's; exported tokens/s "
        f"{SPEED_GOAL[0]}-{SPEED_GOAL[1]}x the probe's, measured back to back"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['job']}: first try {row['first_try']}: {row['error']}")
            continue
        peak_ok = abs(row["peak_ratio"] - 1) <= PEAK_GOAL
        speed_ok = SPEED_GOAL[0] <= row["speed_ratio"] <= SPEED_GOAL[1]
        print(
            f"{row['job']}: first try {row['first_try']}, {row['probes']} probes, best "
            f"{row['best']}; exported/probe peak {row['peak_ratio']:.3f}x "
            f"({'meets' if peak_ok else 'misses'} the goal), tokens/s "
            f"{row['exported_tokens_per_second']:.0f} vs {row['probe_tokens_per_second']:.0f} "
            f"tokens/s = {row['speed_ratio']:.2f}x ({'meets' if speed_ok else 'misses'} the goal)"
        )
        print(f"  {row['command']}")


if __name__ == "__main__":
    main()

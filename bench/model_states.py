"""Bytes per parameter each engine really holds: the ground truth for the memory estimator.

On the CPU, a probe's "device" memory is the exact byte count of live tensors (the probe's
LiveTensorBytes counter), so a model with negligible activations (sequence length 4, micro-batch
1) shows what each engine keeps per parameter: weights, gradients, optimizer state, master
copies, flat buffers, buckets. Printed per engine, ZeRO stage, offload and rank count, as
multiples of the parameter count P, after the build and at the training step's peak.

On the CPU offloaded states are counted too (host and "device" are the same memory), so the
offload rows show the engine's total footprint, not what would stay on a GPU.

    python bench/model_states.py [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from autotune.config import TrainConfig
from autotune.models import resolve_model
from autotune.probe import ProbeSpec, launch_probe
from autotune.probe.forkserver import ForkServer

# Four llama blocks of hidden 256: 2.75M parameters, so at sequence length 4 the activations
# are a rounding error (well under 0.1 % of the model states).
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "use_cache": False,
}

CONFIGS: list[dict[str, Any]] = [
    {"engine": "single"},
    {"engine": "single", "precision": "bf16"},
    {"engine": "single", "precision": "fp32"},
    {"engine": "ddp"},
    {"engine": "fsdp", "zero_stage": 2},
    {"engine": "fsdp", "zero_stage": 3},
    {"engine": "fsdp", "zero_stage": 3, "offload": "params"},
    {"engine": "deepspeed", "zero_stage": 0},
    {"engine": "deepspeed", "zero_stage": 1},
    {"engine": "deepspeed", "zero_stage": 2},
    {"engine": "deepspeed", "zero_stage": 3},
    {"engine": "deepspeed", "zero_stage": 2, "offload": "optimizer"},
    {"engine": "deepspeed", "zero_stage": 3, "offload": "params"},
]


def measure(root: Path) -> list[dict[str, Any]]:
    config_path = root / "model" / "config.json"
    config_path.parent.mkdir(parents=True)
    config_path.write_text(json.dumps(MODEL_CONFIG))
    params = resolve_model(str(config_path)).num_params
    rows = []
    with ForkServer() as server:
        for knobs in CONFIGS:
            config = TrainConfig(**knobs)
            for ranks in (1,) if knobs["engine"] == "single" else (1, 2):
                spec = ProbeSpec(
                    model=str(config_path),
                    config=config,
                    micro_batch_sizes=(1,),
                    seq_len=4,
                    num_processes=ranks,
                    device="cpu",
                    warmup_steps=1,
                    timed_steps=1,
                )
                result = launch_probe(spec, root / f"probe{len(rows)}", spawner=server)
                report = json.loads((result.probe_dir / "rank0.json").read_text())
                build = report.get("build_memory", {}).get("peak_allocated_bytes")
                step = result.sizes[0].peak_allocated_bytes if result.sizes else None
                rows.append(
                    {
                        "config": config.label(),
                        "ranks": ranks,
                        "outcome": result.outcome.value,
                        "params": params,
                        "build_peak_bytes": build,
                        "step_peak_bytes": step,
                        "build_peak_per_param": build / params if build else None,
                        "step_peak_per_param": step / params if step else None,
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"model: llama-style, {rows[0]['params']:,} parameters (P); sequence 4, micro-batch 1;"
        " bytes of live tensors on the CPU"
    )
    print(f"{'configuration':<36} {'ranks':>5} {'after build':>12} {'step peak':>10}  outcome")
    for row in rows:
        build = row["build_peak_per_param"]
        step = row["step_peak_per_param"]
        print(
            f"{row['config']:<36} {row['ranks']:>5} "
            f"{(f'{build:.2f} P' if build else '-'):>12} {(f'{step:.2f} P' if step else '-'):>10}"
            f"  {row['outcome']}"
        )


if __name__ == "__main__":
    main()

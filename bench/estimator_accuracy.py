"""Predicted vs traced peak memory for every preset: the memory model's accuracy table.

The reference is one real training step traced under fake tensors
(``autotune.probe.trace``), which equals a real CPU step byte for byte and extrapolates
exactly in depth. For every preset, at micro-batch 1 and 4, with and without activation
checkpointing (single GPU, bf16 mixed precision), and for FSDP2 ZeRO-3 on 8 ranks, it prints
the analytic prediction, the traced peak and the error; then the median and largest absolute
errors. Prints a Markdown table (``--json`` for machines).

    python bench/estimator_accuracy.py [--json] [--models llama-7b,qwen2.5-7b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from autotune.config import TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import preset_names, resolve_model
from autotune.probe.trace import trace_peak

GIB = 1024**3

CASES: list[tuple[dict[str, Any], int]] = [
    ({}, 1),
    ({"ac_every": 1}, 1),
    ({"engine": "fsdp", "zero_stage": 3}, 8),
    ({"engine": "fsdp", "zero_stage": 3, "ac_every": 1}, 8),
]
MICRO_BATCHES = (1, 4)


def measure(models: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in models:
        model = resolve_model(name)
        seq_len = min(2048, model.max_position_embeddings)
        for knobs, world in CASES:
            config = TrainConfig(**knobs)
            for mbs in MICRO_BATCHES:
                started = time.perf_counter()
                traced = trace_peak(
                    model, config, micro_batch_size=mbs, seq_len=seq_len, world_size=world
                )
                trace_s = time.perf_counter() - started
                predicted = estimate_memory(
                    model, config, micro_batch_size=mbs, seq_len=seq_len, world_size=world
                )
                rows.append(
                    {
                        "model": name,
                        "config": config.label(),
                        "ranks": world,
                        "micro_batch_size": mbs,
                        "seq_len": seq_len,
                        "predicted_bytes": predicted.peak_bytes,
                        "traced_bytes": traced.peak_bytes,
                        "error": predicted.peak_bytes / traced.peak_bytes - 1,
                        "predicted_phase": predicted.phase,
                        "traced_at": traced.peak_at,
                        "trace_s": trace_s,
                    }
                )
                if _VERBOSE:
                    print(json.dumps(rows[-1]), flush=True)
    return rows


_VERBOSE = False


def main() -> None:
    global _VERBOSE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", default=",".join(preset_names()))
    parser.add_argument("--verbose", action="store_true", help="Print each row as it is done.")
    args = parser.parse_args()
    _VERBOSE = args.verbose
    rows = measure([m for m in args.models.split(",") if m])
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| model | configuration | ranks | mbs | seq | predicted | traced | error | traced at |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['config']} | {r['ranks']} | {r['micro_batch_size']} "
            f"| {r['seq_len']} | {r['predicted_bytes'] / GIB:.2f} GiB "
            f"| {r['traced_bytes'] / GIB:.2f} GiB | {r['error']:+.1%} | {r['traced_at']} |"
        )
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= 0.05 for e in errors)
    print(
        f"\n{len(rows)} rows: median |error| {statistics.median(errors):.1%}, "
        f"largest {max(errors):.1%}, {within} within 5%; "
        f"tracing took {sum(r['trace_s'] for r in rows):.0f} s"
    )


if __name__ == "__main__":
    main()

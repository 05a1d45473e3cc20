"""LoRA's memory on the CPU: real probes of full fine-tuning and of LoRA beside it, their peaks
and the saving against what the estimator predicts.

Each row probes a 3-layer llama (hidden 96, intermediate 320, one key-value head, vocabulary
3,000; not the shape the estimator's LoRA terms were written on) at 1 and 4 sequences of 256
tokens, once fully fine-tuned and once with rank-8 adapters, and reads the probe's live-tensor
counter. The goal: each peak within 2 % of the estimate, and each saving within 2 % of the
predicted saving (in pure bf16 LoRA costs memory at the larger size: peft's fp32 copies of every
adapted layer's input outweigh the frozen states there, which the estimator predicts).

    python bench/lora_memory.py [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

from autotune.config import Precision, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import launch_probe
from autotune.probe.outcome import Outcome
from autotune.probe.spec import ProbeSpec

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 3000,
    "hidden_size": 96,
    "intermediate_size": 320,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
RANK = 8
SEQ = 256
SIZES = (1, 4)
GOAL = 0.02
"""Largest relative error of a peak, and of a saving, against the estimate."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as folder, ForkServer() as server:
        root = Path(folder)
        (root / "config.json").write_text(json.dumps(SHAPE))
        model = str(root / "config.json")
        spec = resolve_model(model)
        for precision in (Precision.FP32, Precision.BF16, Precision.BF16_MIXED):
            peaks: dict[tuple[int, int], tuple[int, int]] = {}
            for rank in (0, RANK):
                config = TrainConfig(precision=precision, lora_rank=rank)
                probe = ProbeSpec(
                    model=model,
                    config=config,
                    micro_batch_sizes=SIZES,
                    seq_len=SEQ,
                    device="cpu",
                    warmup_steps=1,
                    timed_steps=2,
                    timeout_s=300.0,
                )
                result = launch_probe(probe, root / f"{precision.value}-{rank}", spawner=server)
                if result.outcome is not Outcome.OK:
                    raise SystemExit(f"{config.label()}: {result.outcome.value} {result.message}")
                for size in result.sizes:
                    predicted = estimate_memory(
                        spec,
                        config,
                        micro_batch_size=size.micro_batch_size,
                        seq_len=SEQ,
                        cuda_allocator=False,
                    ).peak_bytes
                    peaks[(rank, size.micro_batch_size)] = (size.peak_allocated_bytes, predicted)
            for mbs in SIZES:
                (full, full_predicted), (lora, lora_predicted) = peaks[(0, mbs)], peaks[(RANK, mbs)]
                saved, saved_predicted = full - lora, full_predicted - lora_predicted
                rows.append(
                    {
                        "precision": precision.value,
                        "micro_batch_size": mbs,
                        "full_bytes": full,
                        "full_predicted_bytes": full_predicted,
                        "lora_bytes": lora,
                        "lora_predicted_bytes": lora_predicted,
                        "saved_bytes": saved,
                        "saved_predicted_bytes": saved_predicted,
                        "peak_error": max(
                            abs(full / full_predicted - 1), abs(lora / lora_predicted - 1)
                        ),
                        "saving_error": abs(saved / saved_predicted - 1),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"LoRA rank {RANK} against full fine-tuning, {SEQ} tokens a sequence (bytes)")
    print("| precision | mbs | full | LoRA | saved | predicted saving | peaks' worst error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['precision']} | {r['micro_batch_size']} | {r['full_bytes']:,} B "
            f"| {r['lora_bytes']:,} B | {r['saved_bytes']:,} B | {r['saved_predicted_bytes']:,} B "
            f"({r['saving_error']:.2%} off) | {r['peak_error']:.2%} |"
        )
    worst_peak = max(r["peak_error"] for r in rows)
    worst_saving = max(r["saving_error"] for r in rows)
    print(
        f"worst peak error {worst_peak:.2%}, worst saving error {worst_saving:.2%} "
        f"(goal: both within {GOAL:.0%})"
    )


if __name__ == "__main__":
    main()

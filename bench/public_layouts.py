"""Published TP/PP/CP layouts against autotune's plan: for each, the layout's own predicted
peak and speed at its published micro-batch, whether it fits an 80 GB H100 by that estimate,
and the layout the plan ranks first for the same model, GPUs, sequence and global batch.

The layouts are torchtitan's (pytorch/torchtitan, docs/performance.md at eaea6f6 and
torchtitan/models/llama3/train_configs/*.toml), measured on H100s with 96 GB of HBM2e and
trained with torch.compile and Float8 where the table says so; autotune plans bf16 on the
catalogue's 80 GB H100 SXM, so a published peak near 80 GiB need not fit here.

    python bench/public_layouts.py [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

from autotune.config import Engine, Schedule, TrainConfig
from autotune.estimator.parallel import estimate_layout_memory, predict_layout_time
from autotune.estimator.plan import plan, usable_bytes
from autotune.hardware import gpu_spec
from autotune.layouts import LayoutOptions
from autotune.models import resolve_model
from autotune.space import Workload

GiB = 1024**3


@dataclass(frozen=True)
class Published:
    what: str
    model: str
    gpus: int
    seq_len: int
    global_batch: int
    config: TrainConfig
    micro_batch: int
    source: str
    peak_gib: float | None = None


def _fsdp(**layout: Any) -> TrainConfig:
    """FSDP2 with every block checkpointed (torchtitan's "full" AC): ZeRO-3, or ZeRO-2 under a
    pipeline, where torchtitan keeps the gathered weights from the forward to the backward
    (``reshard_after_forward`` off)."""
    return TrainConfig(engine=Engine.FSDP, ac_every=1, **{"zero_stage": 3, **layout})


PUBLISHED = [
    Published("70B, 64 GPUs", "llama3-70b", 64, 8192, 64, _fsdp(tp=8), 8,
              "llama3_70b.toml: FSDP 8 x TP 8, local batch 8, full AC"),
    Published("70B, 256 GPUs", "llama3-70b", 256, 8192, 512, _fsdp(tp=8), 16,
              "performance.md Table 4: FSDP 32 x TP 8, local batch 16, full AC", 71.9),
    Published("405B, 128 GPUs", "llama3.1-405b", 128, 8192, 32, _fsdp(tp=8), 2,
              "performance.md (Llama 3.1 405B): FSDP 16 x TP 8, local batch 2, full AC"),
    Published("405B, 512 GPUs", "llama3.1-405b", 512, 8192, 256, _fsdp(tp=8, pp=8, zero_stage=2), 1,
              "performance.md Table 5: FSDP 8 x TP 8 x PP 8, 1F1B, local batch 32, full AC",
              82.5),
    Published("405B, 512 GPUs, interleaved", "llama3.1-405b", 512, 8192, 256,
              _fsdp(tp=8, pp=8, zero_stage=2, pp_schedule=Schedule.INTERLEAVED_1F1B,
                    pp_virtual=2), 1,
              "performance.md Table 5: the same, interleaved 1F1B", 72.7),
    Published("8B at 128k, 8 GPUs", "llama3.1-8b", 8, 131072, 2, _fsdp(cp=4), 1,
              "performance.md Table 2: FSDP 2 x CP 4, local batch 1, full AC", 84.0),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gpu = gpu_spec("h100-80gb")
    capacity = usable_bytes(gpu)
    results = []
    for case in PUBLISHED:
        model = resolve_model(case.model)
        dp = case.gpus // case.config.model_parallel
        accum = case.global_batch // (dp * case.micro_batch)
        memory = estimate_layout_memory(
            model,
            case.config,
            micro_batch_size=case.micro_batch,
            seq_len=case.seq_len,
            world_size=case.gpus,
            grad_accum=accum,
        )
        speed = predict_layout_time(
            model,
            case.config,
            gpu,
            micro_batch_size=case.micro_batch,
            seq_len=case.seq_len,
            world_size=case.gpus,
            grad_accum=accum,
        )
        workload = Workload(
            seq_len=case.seq_len, global_batch=case.global_batch, world_size=case.gpus
        )
        started = time.perf_counter()
        rows = plan(model, gpu, workload, layouts=LayoutOptions(), offload=False)
        seconds = time.perf_counter() - started
        first = rows[0]
        results.append(
            {
                "case": case.what,
                "source": case.source,
                "published": f"{case.config.label()} mbs {case.micro_batch} accum {accum}",
                "published_peak_gib": case.peak_gib,
                "predicted_peak_gib": round(memory.device_bytes / GiB, 1),
                "fits": memory.device_bytes <= capacity,
                "predicted_tokens_per_s_per_gpu": round(speed.tokens_per_second / case.gpus),
                "plan_first": f"{first.config.label()} mbs {first.micro_batch_size} "
                f"accum {first.grad_accum}",
                "plan_first_fits": first.fits,
                "plan_first_tokens_per_s_per_gpu": round(first.tokens_per_second / case.gpus),
                "plan_seconds": round(seconds, 2),
            }
        )
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"usable per GPU: {capacity / GiB:.1f} GiB (h100-80gb, bf16, no offload)")
    for r in results:
        print(f"\n{r['case']}  ({r['source']})")
        print(
            f"  published {r['published']}: predicted {r['predicted_peak_gib']} GiB "
            f"(published {r['published_peak_gib'] or '-'} GiB on 96 GB), "
            f"fits: {'yes' if r['fits'] else 'no'}, "
            f"{r['predicted_tokens_per_s_per_gpu']:,} tokens/s/GPU predicted"
        )
        print(
            f"  plan's first: {r['plan_first']}, fits: {'yes' if r['plan_first_fits'] else 'no'}, "
            f"{r['plan_first_tokens_per_s_per_gpu']:,} tokens/s/GPU ({r['plan_seconds']} s)"
        )


if __name__ == "__main__":
    main()

"""Host time per tensor of an optimizer step: fused AdamW against torchao's AdamW8bit.

torchao's AdamW8bit calls one torch.compile'd function per parameter tensor (guards, the
tensor subclass's flatten and unflatten around a fused kernel), where fused AdamW launches one
kernel for a whole group. On a GPU the kernels run asynchronously, so a step of many small
tensors is bound by this host time; the time model charges it per tensor
(``autotune.estimator.timing._COMPILED_STEP_CALL_S``). Measured here on the CPU with tensors of
4,096 values, the smallest that are quantized, whose compute is a few microseconds; larger
tensors show the CPU's own arithmetic, which a GPU does instead.

    python bench/optimizer_step.py [--tensors 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from autotune.config import OPTIMIZER_8BIT_BLOCK, OPTIMIZER_8BIT_MIN_VALUES

GOAL_US = 250.0
"""The per-tensor host time the time model assumes for 8-bit AdamW (``_COMPILED_STEP_CALL_S``):
this benchmark's figure should not be far above it on the machine the model is used for."""


def per_tensor_us(optimizer: torch.optim.Optimizer, tensors: int, steps: int) -> float:
    optimizer.step()  # compiles (8-bit) and makes the state
    optimizer.step()
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - began) / steps / tensors * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.optim import AdamW8bit

    torch.set_num_threads(1)
    results = {}
    for values in (OPTIMIZER_8BIT_MIN_VALUES, 16 * OPTIMIZER_8BIT_MIN_VALUES):
        params = [torch.nn.Parameter(torch.randn(values)) for _ in range(args.tensors)]
        for p in params:
            p.grad = torch.randn(values)
        fused = torch.optim.AdamW(params, lr=1e-3, fused=True)
        eight = AdamW8bit(params, lr=1e-3, block_size=OPTIMIZER_8BIT_BLOCK)
        results[values] = {
            "adamw_us": per_tensor_us(fused, args.tensors, args.steps),
            "adamw_8bit_us": per_tensor_us(eight, args.tensors, args.steps),
        }
    if args.json:
        print(json.dumps({"goal_us": GOAL_US, "per_tensor": results}, indent=2))
        return
    print(f"optimizer step, host time per tensor (1 thread, {args.tensors} tensors)")
    for values, row in results.items():
        print(
            f"  {values:>7,} values: fused AdamW {row['adamw_us']:7.1f} us, "
            f"AdamW8bit {row['adamw_8bit_us']:7.1f} us"
        )
    print(f"  time model's 8-bit figure: {GOAL_US:.0f} us a tensor (the 4,096-value row)")


if __name__ == "__main__":
    main()

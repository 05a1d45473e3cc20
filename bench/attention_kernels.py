"""Which kernel ``sdpa`` runs here: the aten attention operators one training step of a
model's attention dispatches, per compute dtype and dropout, as docs/attention.md tabulates.

torch picks a kernel per call, from the device, the dtype, the head size, the mask and the
dropout; the names of the operators dispatched say which it picked
(``_scaled_dot_product_flash_attention`` and its CPU twin, ``..._efficient_attention``,
``..._cudnn_attention``, or the math fallback's ``_safe_softmax``). On a GPU node this is the
record docs/attention.md asks for.

    python bench/attention_kernels.py [--model qwen2.5-1.5b] [--seq-len 512] [--json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.config import Attention, Precision, TrainConfig
from autotune.models import resolve_model
from autotune.probe.engines.base import autocast_context, cast_weights
from autotune.probe.modeling import build_model, materialize

KERNEL_WORDS = ("attention", "softmax")


class _Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if any(word in name for word in KERNEL_WORDS):
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def kernels(model: str, device: str, precision: Precision, dropout: float, seq: int) -> list[str]:
    """The attention operators of one forward and backward of ``model``'s first block."""
    spec = resolve_model(model).with_layers(1)
    config = TrainConfig(precision=precision, attention=Attention.SDPA)
    built = build_model(spec, config)
    materialize(built, torch.device(device), seed=0)
    cast_weights(built, precision)
    for module in built.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    ids = torch.randint(0, spec.vocab_size, (1, seq), device=device)
    mode = _Kernels()
    with mode, autocast_context(config, torch.device(device)):
        built(input_ids=ids, labels=ids).loss.backward()
    return sorted(mode.seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for precision in (Precision.BF16_MIXED, Precision.BF16, Precision.FP32):
        for dropout in (0.0, 0.1):
            found = kernels(args.model, device, precision, dropout, args.seq_len)
            rows.append({"precision": precision.value, "dropout": dropout, "ops": found})
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if args.json:
        print(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=2))
        return
    print(f"sdpa on {name} (torch {torch.__version__}), {args.model}, seq {args.seq_len}")
    for row in rows:
        print(f"  {row['precision']:>10}, dropout {row['dropout']}: {', '.join(row['ops'])}")


if __name__ == "__main__":
    main()

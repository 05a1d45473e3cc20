"""Train with the FSDP2 settings autotune exported, as their docstring says: a causal LM from a
config.json (random weights), random token ids, the settings' micro-batch and accumulation.

    autotune export --format fsdp -o fsdp_settings.py
    torchrun --nproc-per-node 2 examples/train_fsdp.py --settings fsdp_settings.py \\
        --model MODEL_DIR --seq-len 2048

The settings file is the only place the batch, the accumulation, the checkpointing and the
sharding come from: this loop is what an exported configuration's user writes.
"""

import argparse
import importlib.util
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM


def load_settings(path: str):
    spec = importlib.util.spec_from_file_location("fsdp_settings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", required=True, help="autotune export --format fsdp's file")
    parser.add_argument("--model", required=True, help="a folder holding the model's config.json")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    settings = load_settings(args.settings)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)

    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if device is not None:
        model = model.to(device)
    model = settings.apply_fsdp(model)
    optimizer = settings.build_optimizer(model, args.lr)

    generator = torch.Generator().manual_seed(rank)
    accumulation = settings.GRAD_ACCUM
    for step in range(args.steps):
        for micro in range(accumulation):
            # Gradients are reduced on the last micro-step only.
            model.set_requires_gradient_sync(micro == accumulation - 1)
            ids = torch.randint(
                0,
                config.vocab_size,
                (settings.MICRO_BATCH_SIZE, args.seq_len),
                generator=generator,
            )
            if device is not None:
                ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss / accumulation
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item() * accumulation:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

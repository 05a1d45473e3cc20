"""A plain torch training loop started by torchrun, as users write them: a causal LM from a
config.json (random weights), random token ids, AdamW, DDP over several ranks. It takes its
batch size, accumulation, precision and checkpointing from autotune when autotune runs it, and
from its own flags otherwise:

    torchrun --nproc-per-node 2 examples/train_torchrun.py --model MODEL_DIR --steps 20

It always trains under DDP (one rank: no wrapper), so autotune tunes it with that engine (a
probe of another is refused, the measurement layer seeing DDP):

    autotune run --script examples/train_torchrun.py --framework torchrun --engine ddp
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import autotune


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a folder holding the model's config.json")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    job = autotune.job_config()  # the configuration autotune hands this run, or None
    batch = job.micro_batch_size if job else args.batch_size
    accum = job.grad_accum if job else 1
    steps = job.max_steps if job and job.max_steps else args.steps

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    distributed = world > 1
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )

    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    if job and job.ac_every:  # blocks 0, k, 2k, ... as autotune measured them
        every = {"every_n_layers": job.ac_every} if job.ac_every > 1 else {}
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}, **every
        )
    if job and job.precision == "bf16":
        model = model.to(torch.bfloat16)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if job and job.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        for _ in range(accum):
            ids = torch.randint(
                0, config.vocab_size, (batch, args.seq_len), generator=generator
            ).to(device)
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item() * accum:.3f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

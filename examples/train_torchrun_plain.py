"""A plain torch training loop started by torchrun, written without autotune in mind: a causal
LM from a config.json (random weights), random token ids, AdamW, DDP over the ranks. Every
setting is one of its own flags:

    torchrun --nproc-per-node 2 examples/train_torchrun_plain.py --model MODEL_DIR \\
        --batch-size 4 --grad-accum 2 --activation-checkpointing

autotune tunes it unedited, told which of its flags carries each knob:

    autotune run --script examples/train_torchrun_plain.py --framework torchrun --engine ddp \\
        --batch-flag --batch-size --accum-flag --grad-accum \\
        --checkpointing-flag --activation-checkpointing -- --model MODEL_DIR

With ``--bf16 --loss-from-logits`` it trains the model in bf16 itself and takes the
cross-entropy of the bf16 logits, without the fp32 copy the model's own loss makes; the
measurement layer sees which dtype the loss ran in.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a folder holding the model's config.json")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--bf16", action="store_true", help="train the model in bf16 itself (no autocast)"
    )
    parser.add_argument(
        "--loss-from-logits",
        action="store_true",
        help="compute the cross-entropy here from the logits, in their dtype",
    )
    args = parser.parse_args()

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
    if args.bf16:
        model = model.to(torch.bfloat16)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        for _ in range(args.grad_accum):
            ids = torch.randint(
                0, config.vocab_size, (args.batch_size, args.seq_len), generator=generator
            ).to(device)
            mixed = (
                contextlib.nullcontext()
                if args.bf16
                else torch.autocast(device.type, dtype=torch.bfloat16)
            )
            with mixed:
                if args.loss_from_logits:
                    logits = model(input_ids=ids).logits
                    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                loss = loss / args.grad_accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item() * args.grad_accum:.3f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain accelerate training loop written without autotune in mind: every setting is one of
its own flags (the Accelerator's accumulation included), the model a causal LM from a
config.json with random weights, the data random token ids made as they are read.

    accelerate launch --config_file accelerate.yaml examples/train_accelerate_plain.py \\
        --model MODEL_DIR --batch-size 4 --grad-accum 2 --gradient-checkpointing

autotune tunes it unedited (its --batch-size, --grad-accum and --gradient-checkpointing are
found by their names): autotune run --script examples/train_accelerate_plain.py \\
    --framework accelerate -- --model MODEL_DIR
"""

import argparse

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random token ids, each made when it is read."""

    def __init__(self, vocab_size: int, seq_len: int, count: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.count, self.seed = vocab_size, seq_len, count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * self.count + index)
        return torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a folder holding the model's config.json")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    config = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    count = args.steps * args.grad_accum * args.batch_size
    data = RandomTokens(config.vocab_size, args.seq_len, count, seed=accelerator.process_index)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and accelerator.is_main_process:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()

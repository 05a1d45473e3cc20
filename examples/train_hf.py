"""A plain Hugging Face Trainer script, as users write them: its TrainingArguments come from
the command line, its model from --model_name_or_path (a folder with a config.json; the
weights are random here), its data a small set of random token ids.

    python examples/train_hf.py --model_name_or_path MODEL_DIR --output_dir out \
        --per_device_train_batch_size 4 --max_steps 20 --seq_len 128

autotune tunes it as is: autotune run --script examples/train_hf.py --framework hf -- <these>
"""

from dataclasses import dataclass, field

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class DataArguments:
    model_name_or_path: str = field(metadata={"help": "a folder holding the model's config.json"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    num_samples: int = field(default=512, metadata={"help": "sequences in the dataset"})


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random token ids, each made when it is read; the labels are the same ids
    (the model shifts them)."""

    def __init__(self, vocab_size: int, seq_len: int, count: int) -> None:
        self.vocab_size, self.seq_len, self.count = vocab_size, seq_len, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator)
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    data_args, training_args = HfArgumentParser(
        (DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    config = AutoConfig.from_pretrained(data_args.model_name_or_path)
    model = AutoModelForCausalLM.from_config(config)
    dataset = RandomTokens(config.vocab_size, data_args.seq_len, data_args.num_samples)
    Trainer(model=model, args=training_args, train_dataset=dataset).train()


if __name__ == "__main__":
    main()

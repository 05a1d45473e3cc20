"""``autotune export --format trl`` read and trained by TRL itself: the exported keyword
arguments build ``GRPOConfig``, and ``GRPOTrainer`` trains two steps of the tiny preset on the
CPU with the export's batch, accumulation, group, completion length and checkpointing.

Only what cannot run on this machine changes, each named where it is set: no vLLM (it does not
install on a CPU-only machine; TRL accepts the export's ``vllm_*`` fields with ``use_vllm``
off, so they stay) and the CPU. The layouts are the single engine's: DeepSpeed's or FSDP's
trainer would need a distributed launch.

The model trains in this process: a single-engine trainer sets no environment variable, and
what it leaves behind (the global random generators seeded with ``GRPOConfig.seed``,
accelerate's process state) no other test reads."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autotune.config import TrainConfig
from tests.test_rlhf_export import WORKLOAD, export, study_with

ROLLOUT_BATCH = 12
"""Sequences a generation: TRL's group is then 6 samples a prompt (the export's largest divisor
up to 8), so one generation is 2 prompts and the group is not the whole batch."""
PROMPTS = 4
"""Two steps of 2 prompts: one epoch, no prompt twice in a generation."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread while the test trains, as the suite's subprocesses run
    (``OMP_NUM_THREADS=1``): two test workers on two cores, each spinning two threads, made the
    two steps ten times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def trl_export(tmp_path: Path, config: TrainConfig) -> dict[str, Any]:
    """The keyword arguments ``autotune export --format trl`` writes for a study of
    ``config``."""
    storage = study_with(tmp_path, config, rollout_batch=ROLLOUT_BATCH)
    code, out, err = export("--format", "trl", "--model", "tiny", "--storage", storage)
    assert code == 0, err
    fields: dict[str, Any] = json.loads(out)
    return fields


def tiny_tokenizer(config: Any) -> Any:
    """A word-level tokenizer over the tiny model's whole vocabulary, with the model's BOS and
    EOS ids and a pad token: ``<pad>``, ``<s>``, ``</s>``, ``<unk>``, then ``w4`` to ``w255``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {0: "<pad>", config.bos_token_id: "<s>", config.eos_token_id: "</s>", 3: "<unk>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(config.vocab_size)}
    assert len(vocab) == config.vocab_size
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "config", [TrainConfig(ac_every=1), TrainConfig()], ids=lambda c: c.label()
)
def test_grpo_trainer_trains_two_steps_of_the_export(tmp_path: Path, config: TrainConfig) -> None:
    """Two optimizer steps, each one generation of the study's rollout batch in groups of the
    exported ``num_generations``, with the model checkpointed as the layout was measured: on
    for ``ac:every``, off for ``ac:off`` (GRPOConfig's own default is on)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from autotune.models import resolve_model
    from autotune.probe.modeling import hf_config

    fields = trl_export(tmp_path, config)
    assert fields["activation_checkpointing"] is (config.ac_every == 1)
    assert fields["use_vllm"] is True
    args = GRPOConfig(
        **{
            **fields,
            "use_vllm": False,  # vLLM does not install on this CPU-only machine
            "use_cpu": True,  # no GPU here
            "output_dir": str(tmp_path / "out"),
            "report_to": "none",
            "max_steps": 2,
            "logging_steps": 1,
            "save_strategy": "no",
        }
    )

    model_config = hf_config(resolve_model("tiny"))
    model_config.pad_token_id = 0
    # The probes' config drops the KV cache (they only train); a policy generates with it.
    model_config.use_cache = True
    tokenizer = tiny_tokenizer(model_config)
    model = AutoModelForCausalLM.from_config(model_config)
    before = model.lm_head.weight.detach().clone()

    generations: list[tuple[list[str], list[str]]] = []

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        """The mean word number of a completion: it differs within a group, so the advantages
        are not all zero and the policy moves."""
        generations.append((list(prompts), list(completions)))
        words = [[int(w[1:]) for w in c.split() if w.startswith("w")] for c in completions]
        return [sum(ids) / len(ids) if ids else 0.0 for ids in words]

    checkpointed: list[bool] = []

    class Checkpointing(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            checkpointed.append(model.is_activation_checkpointing)

    prompts = [" ".join(f"w{10 * p + i}" for i in range(4)) for p in range(PROMPTS)]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[Checkpointing()],
    )
    assert not trainer.use_vllm
    assert trainer.accelerator.mixed_precision == ("bf16" if fields["bf16"] else "no")
    # The export's fields reach the trainer as written.
    assert args.per_device_train_batch_size == fields["per_device_train_batch_size"] == 2
    assert args.gradient_accumulation_steps == fields["gradient_accumulation_steps"] == 6
    assert args.steps_per_generation == fields["steps_per_generation"] == 6
    assert args.max_completion_length == fields["max_completion_length"]
    assert args.max_completion_length == WORKLOAD["response_len"]
    # TRL derives one generation's batch from them: the study's rollout batch.
    assert args.generation_batch_size == ROLLOUT_BATCH
    assert trainer.num_generations == fields["num_generations"] == 6
    trainer.train()

    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert all(math.isfinite(entry["loss"]) and "reward" in entry for entry in logged)
    assert not torch.equal(model.lm_head.weight.detach(), before)  # the optimizer stepped
    # One generation a step, of the rollout batch: 2 prompts, each sampled num_generations
    # times.
    assert len(generations) == 2
    for seen, completions in generations:
        assert len(seen) == len(completions) == ROLLOUT_BATCH
        groups = Counter(seen)
        assert set(groups.values()) == {fields["num_generations"]}
        assert len(groups) == ROLLOUT_BATCH // fields["num_generations"]
    assert checkpointed == [fields["activation_checkpointing"]] * 2

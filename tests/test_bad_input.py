"""Bad input, command by command: one line that says what to do, exit 2, nothing written.

Each case runs the console entry point (``autotune.cli.main``) in this process, with its
arguments and working folder, and checks the exit code, that stderr is one line naming the
problem, and that no file appeared or changed (no trial database, no probe folder, no output
file). A few run again through a fresh interpreter, as a shell runs the ``autotune`` command.
docs/reliability.md lists them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.models import resolve_model
from tests.test_cli import autotune

SIM = ("--simulate", "h100-80gb")
CPU = ("--model", "tiny", "--device", "cpu", "--device-memory", "4MiB")
L70 = ("plan", "--model", "llama3-70b", "--gpu", "h100-80gb", "--gpus")
TPCPU = ("probe", "--model", "tiny", "--device", "cpu", "--device-memory", "64MiB")
RL = ("plan", "--rlhf", "ppo", "--model", "qwen2.5-1.5b", "--gpu", "a100-80gb", "--gpus", "4")

CASES: list[tuple[tuple[str, ...], str]] = [
    # The model.
    (("run", "--model", "llama-7bb", *SIM), "did you mean llama-7b"),
    (("plan", "--model", "qwen-1.5b", "--gpu", "h100"), "did you mean"),
    (("run", "--model", "notjson", *SIM), "cannot load model config from 'notjson': Expecting"),
    (("plan", "--model", "listjson", "--gpu", "h100"), "expected a JSON object, found list"),
    (("plan", "--model", "bert", "--gpu", "h100"), "BertForMaskedLM ('bert'), not a decoder-only"),
    (("plan", "--model", "t5", "--gpu", "h100"), "model config 't5' is a 't5', not a causal LM"),
    (("run", "--model", "empty", *SIM), "'empty' holds no config.json"),
    (("plan", "--model", "nomodeltype", "--gpu", "h100"), "no model_type field"),
    # Tensor, pipeline and context parallel degrees (autotune/layouts.py).
    ((*L70, "64", "--tp", "3"), "--tp 3 x --pp 1 x --cp 1 = 3 ranks do not divide 64 GPUs"),
    ((*L70, "64", "--tp", "16"), "--tp 16 does not fit in a node of 8 GPUs"),
    ((*L70, "128", "--pp", "128"), "--pp 128 = 128 stages are more than llama3-70b's 80 layers"),
    ((*L70, "48", "--cp", "3", "--seq-len", "8192"), "does not split into 6 equal chunks"),
    (("plan", "--gpu", "h100", "--gpus", "4", "--pp", "4", "--model", "tiny"), "tiny's 2 layers:"),
    (
        ("plan", "--model", "qwen2.5-1.5b", "--gpu", "h100", "--gpus", "8", "--tp", "4"),
        "12 attention heads and 2 key/value heads do not split over 4 ranks: use a divisor of 2",
    ),
    (("plan", "--model", "gpt2", "--gpu", "h100", "--gpus", "8", "--tp", "2"), "gpt2 is a GPT-2"),
    (("plan", "--gpu", "h100-80gb", "--gpus", "8", "--tp", "0"), "--tp 0: use a degree of 1"),
    (("plan", "--gpu", "h100-80gb", "--gpus", "8", "--pp", "two"), "--pp two: use a degree"),
    ((*TPCPU, "--gpus", "3", "--tp", "2"), "--tp 2 does not divide 3 ranks: use --gpus a"),
    ((*TPCPU, "--gpus", "4", "--tp", "2", "--engine", "ddp"), "use --engine fsdp with --tp"),
    ((*TPCPU, "--gpus", "2", "--pp", "2"), "needs at least 2 microbatches a step: use --grad"),
    ((*TPCPU, "--gpus", "4", "--pp", "2", "--grad-accum", "4"), "probes one pipeline over all"),
    # A layout a run keeps (run --tp/--pp/--cp).
    (("run", *SIM, "--gpus", "8", "--tp", "3"), "= 3 ranks do not divide 8 GPUs"),
    (("run", *SIM, "--gpus", "8", "--pp-virtual", "2"), "shape a pipeline: give --pp 2 or more"),
    (("run", *SIM, "--gpus", "8", "--pp", "2"), "--pp 2 probes one pipeline over all its ranks"),
    (("run", *SIM, "--gpus", "8", "--tp", "0"), "--tp 0: use 1 or more"),
    (
        ("run", *SIM, "--gpus", "8", "--tp", "2", "--global-batch", "10"),
        "global batch 10 is not a multiple of 4 data-parallel ranks",
    ),
    (("run", *SIM, "--gpus", "8", "--tp", "2", "--jobs", "j.yaml"), "leave them out with --jobs"),
    (("run", *SIM, "--gpus", "8", "--pp", "2", "--pp-schedule", "zb"), "unknown pipeline schedule"),
    (
        (
            "probe",
            "--model",
            "tiny-qwen",
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "--gpus",
            "2",
            "--pp",
            "2",
            "--grad-accum",
            "2",
        ),
        "tiny-qwen ties its output layer to its embedding",
    ),
    # Budgets, sizes and counts.
    (("run", *SIM, "--budget", "-5m"), "invalid duration '-5m'"),
    (("run", *SIM, "--budget", "abc"), "invalid duration 'abc'"),
    (("run", *SIM, "--budget", "0s"), "the budget must be positive"),
    (("run", *SIM, "--budget", "30"), "the budget 30 has no unit: write it like 45m, 90s"),
    (("probe", "--timeout", "90"), "the probe timeout 90 has no unit"),
    (("probe", "--micro-batch", "0"), "invalid micro-batch '0'"),
    (("run", *SIM, "--seq-len", "0"), "seq-len must be at least 1"),
    (("plan", "--gpu", "h100", "--seq-len", "8192"), "--seq-len 8192 is longer than llama-7b"),
    (("probe", "--model", "tiny", "--seq-len", "4096"), "tiny takes (512 positions"),
    (("run", *SIM, "--gpus", "8", "--global-batch", "100"), "not a multiple of 8 GPUs"),
    (("plan", "--gpu", "h100-80gb", "--gpus", "8", "--global-batch", "100"), "multiple of 8"),
    (("run", *SIM, "--headroom", "150%"), "between 0% and 100%"),
    (("plan", "--gpu", "h100", "--headroom", "150%"), "between 0% and 100%"),
    (("probe", "--device-memory", "20XB"), "invalid size '20XB'"),
    (("probe", "--timeout", "soon"), "soon"),
    # What the node has.
    (("run", *CPU, "--gpus", "64"), "--gpus 64 on the CPU starts 64 rank processes"),
    # Nodes.
    (("run", *CPU, "--nodes", "2"), "--nodes 2 needs the hosts: run inside a Slurm allocation"),
    (("probe", "--device", "cpu", "--engine", "ddp", "--nodes", "0"), "--nodes 0: use 1 or more"),
    (("run", *CPU, "--hosts", "node2,localhost"), "put this host first"),
    (("run", *CPU, "--hosts", "localhost,node2,node2"), "names a host twice"),
    (("run", *CPU, "--hosts", "localhost,127.0.0.2", "--gpus", "3"), "split evenly over 2"),
    (("run", *SIM, "--hosts", "localhost,node2"), "leave it out with --simulate"),
    (("run", *CPU, "--hosts", "localhost,-oProxyCommand=touch pwned"), "is not a host name"),
    (("probe", "--device", "cpu", "--hosts", "localhost,a;b"), "'a;b' is not a host name"),
    (("run", "--device", "cuda"), "no GPU"),
    (("probe", "--device", "cuda"), "no GPU is visible: use --device cpu"),
    (("run", *SIM, "--device-memory", "200GiB"), "more than the h100-80gb's 79.65 GiB"),
    (("run", "--simulate", "h100x"), "unknown GPU 'h100x'"),
    (("plan", "--gpu", "tpu-v9"), "tpu-v9"),
    (("run", *CPU, "--objective", "mfu"), "--objective tokens on the CPU"),
    # Configurations.
    (("probe", "--engine", "fsdp", "--zero-stage", "1"), "use --engine deepspeed"),
    (("probe", "--ac", "sometimes"), "invalid activation checkpointing 'sometimes'"),
    (("probe", "--ac", "every+ops"), "op-level checkpointing has none left: use --ac every"),
    (("probe", "--ac", "ops+ops"), "invalid activation checkpointing 'ops'"),
    (("probe", "--engine", "ddp", "--offload", "optimizer"), "--engine deepspeed or fsdp"),
    (("probe", "--engine", "quantum"), "quantum"),
    (("plan", "--gpu", "h100", "--engine", "megatron"), "unknown engine"),
    (("probe", "--model", "llama-99b"), "unknown model 'llama-99b'"),
    # Numbers in other digits than ASCII's (int() and float() take them).
    (
        ("plan", "--gpu", "h100", "--tp", "\uff12"),
        "is a number written in other digits than ASCII's: write it 2",
    ),
    (("run", *SIM, "--gpus=\u0668"), "'\u0668' is a number written in other digits"),
    # A layout's engine, and a probe's accumulation.
    (
        ("run", *SIM, "--gpus", "8", "--tp", "2", "--engine", "ddp"),
        "--tp 2 on 8 GPUs shards the rest of each replica's ranks under FSDP2, which "
        "--engine ddp leaves out: use --engine fsdp",
    ),
    (
        ("run", *SIM, "--gpus", "8", "--tp", "2", "--engine", "single"),
        "which --engine single leaves out: use --engine fsdp",
    ),
    (
        ("plan", "--gpu", "h100", "--gpus", "8", "--tp", "2", "--pp", "1", "--engine", "ddp"),
        "which --engine ddp leaves out: use --engine fsdp",
    ),
    (
        ("probe", "--device", "cpu", "--gpus", "2", "--pp", "2", "--grad-accum", "99999999999"),
        "--grad-accum 99,999,999,999 micro-steps a step: a probe runs at most 65,536",
    ),
    # Trial storage.
    (("run", *SIM, "--storage", "sqlite://"), "in-memory database: every trial would be lost"),
    (("run", *SIM, "--storage", "trials.db"), "not a storage URL: use sqlite:///trials.db"),
    (("best", "--storage", "postgres:/x"), "not a storage URL"),
    (("trials", "--storage", "postgres//x"), "not a storage URL"),
    (("run", *SIM, "--storage", "mysql://u@h/db"), "cannot open trial storage 'mysql://u@h/db'"),
    (("best", "--storage", "postgresql://u:s3cret@127.0.0.1:1/db"), "u:***@127.0.0.1:1/db"),
    (("best", "--storage", "postgresql://u@127.0.0.1:1/db?password=s3cret"), "?password=***'"),
    # Input that was taken though wrong.
    (("plan", "--gpu", "h100", "--global-batch", "10000000000"), "use 16,777,216 or fewer"),
    (("run", *SIM, "--global-batch", "10000000000"), "more sequences per step than any"),
    (("run", "--model", "", *SIM), "the model name is empty"),
    (("plan", "--model", "x" * 300, "--gpu", "h100"), "unknown model 'xxxxxxxx"),
    (("run", *SIM, "--engine", ""), "unknown engine in ''"),
    (("plan", "--gpu", "h100", "--engine", "fsdp,"), "unknown engine in 'fsdp,'"),
    (
        ("plan", "--gpu", "h100", "--loss", "liger"),
        "unknown loss in 'liger': use full or chunked or",
    ),
    (("probe", "--device", "cpu", "--loss", "fused"), "--loss fused runs Liger-Kernel's Triton"),
    (("run", *CPU, "--loss", "full,fused"), "--loss fused runs Liger-Kernel's Triton kernels"),
    (
        (
            "probe",
            "--device",
            "cpu",
            "--engine",
            "deepspeed",
            "--zero-stage",
            "3",
            "--loss",
            "fused",
        ),
        "ZeRO-3 holds only a partition of it: use --loss chunked with ZeRO-3",
    ),
    (("run", *SIM, "--loss", "full,"), "unknown loss in 'full,'"),
    (
        ("plan", "--gpu", "h100", "--optimizer", "adam8"),
        "unknown optimizer in 'adam8': use adamw or adamw-8bit",
    ),
    (("probe", "--optimizer", "adam8"), "adam8"),
    (
        ("probe", *CPU, "--attention", "flash_attention_2"),
        "--attention flash_attention_2 runs flash-attn's CUDA kernels: use --attention sdpa",
    ),
    (
        ("run", *CPU, "--attention", "flash_attention_2"),
        "--attention flash_attention_2 runs flash-attn's CUDA kernels",
    ),
    (
        ("plan", "--gpu", "h100", "--attention", "flash_attention_2", "--precision", "fp32"),
        "flash attention computes in bf16 or fp16",
    ),
    (
        ("probe", *CPU, "--engine", "deepspeed", "--optimizer", "adamw-8bit"),
        "DeepSpeed's ZeRO steps its own optimizer over flat fp32 partitions",
    ),
    (
        (
            "probe",
            *CPU,
            "--engine",
            "fsdp",
            "--zero-stage",
            "3",
            "--offload",
            "params",
            "--optimizer",
            "adamw-8bit",
        ),
        "8-bit AdamW keeps its moments on the device",
    ),
    (
        ("probe", *CPU, "--engine", "fsdp", "--zero-stage", "3", "--lora-rank", "8"),
        "LoRA trains adapters too small to shard: use --engine single or ddp",
    ),
    (("probe", *CPU, "--lora-rank", "-2"), "LoRA rank -2: use a rank of 1 or more"),
    (
        ("probe", *CPU, "--engine", "deepspeed", "--zero-stage", "2", "--act-offload"),
        "activation offload is not wired for DeepSpeed",
    ),
    (("probe", *CPU, "--ac", "ops", "--act-offload"), "activation offload cannot move"),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--act-offload"),
        "leave out --act-offload with --script",
    ),
    # RLHF: the founding case's layout, bent.
    (
        (*RL, "--rollout-share", "1.2"),
        "--rollout-share 1.2: use a fraction of the GPU strictly between 0 and 1",
    ),
    ((*RL, "--rollout-share", "0"), "--rollout-share 0: use a fraction"),
    ((*RL, "--rollout-share", "100%"), "--rollout-share 1: use a fraction"),
    ((*RL, "--rollout-share", "half"), "--rollout-share 'half': use fractions such as 0.5"),
    ((*RL[:2], "grpo", *RL[3:], "--critic", "qwen2.5-7b"), "GRPO has no critic"),
    ((*RL, "--critic", "none"), "PPO trains a critic"),
    ((*RL, "--reference", "gpt2"), "the reference gpt2 has a vocabulary of 50,257 tokens"),
    ((*RL, "--reward", "gpt2"), "the reward model gpt2 embeds 50,257 tokens, fewer than"),
    ((*RL, "--rollout-batch", "6"), "--rollout-batch 6 is not a multiple of 4 GPUs"),
    ((*RL, "--seq-len", "512", "--response-len", "512"), "--response-len 512 leaves no prompt"),
    ((*RL, "--frozen", "cpu"), "--frozen 'cpu': use gpu"),
    ((*RL, "--global-batch", "8"), "--global-batch is not planned with --rlhf"),
    ((*RL[:2], "dpo", *RL[3:]), "--rlhf 'dpo': use ppo or grpo"),
    (
        ("plan", "--gpu", "h100", "--rollout-share", "0.5"),
        "--rollout-share plans an RL iteration: add --rlhf",
    ),
    (("probe", *CPU, "--rlhf", "ppo"), "--rlhf needs --rollout-share"),
    (("probe", *CPU, "--rollout-share", "0.5"), "--rollout-share probes an RL iteration"),
    (("probe", *CPU, "--rlhf", "ppo", "--rollout-share", "0.4,0.6"), "a probe holds one share"),
    (
        (
            "probe",
            *CPU,
            "--rlhf",
            "ppo",
            "--rollout-share",
            "0.5",
            "--frozen",
            "host",
            "--engine",
            "ddp",
            "--gpus",
            "2",
        ),
        "--frozen host is probed on one rank",
    ),
    (
        ("probe", "--model", "tiny", "--device", "cpu", "--rlhf", "grpo", "--rollout-share", "0.5"),
        "--rlhf on the CPU needs --device-memory",
    ),
    (
        ("probe", *CPU, "--rlhf", "grpo", "--rollout-share", "0.5", "--critic", "tiny"),
        "GRPO has no critic",
    ),
    (
        ("probe", *CPU, "--rlhf", "ppo", "--rollout-share", "0.5", "--reference", "gpt2"),
        "cannot pair",
    ),
    (("run", *CPU, "--rollout-share", "0.5"), "--rollout-share tunes an RL iteration"),
    (("run", *CPU, "--rlhf", "ppo", "--global-batch", "8"), "--global-batch is not tuned with"),
    (("run", *CPU, "--rlhf", "ppo", "--gpus", "2", "--frozen", "host"), "--frozen host is probed"),
    (("run", *CPU, "--rlhf", "grpo", "--critic", "tiny"), "GRPO has no critic"),
    (("run", *CPU, "--rlhf", "ppo", "--rollout-share", "2"), "--rollout-share 2: use a fraction"),
    (
        ("run", "--model", "tiny", "--device", "cpu", "--rlhf", "ppo"),
        "--rlhf on the CPU needs --device-memory",
    ),
    (("export", "--format", "trl", "--model", "tiny"), "run autotune run --rlhf first"),
    (("export", "--format", "verl", "--trial", "3"), "--format verl exports an RLHF study's"),
    (("plan", "--gpu", "h100", "--allow", "qlora"), "--allow qlora: use --allow lora"),
    (("plan", "--gpu", "h100", "--allow", "lora", "--lora-rank", "0"), "--lora-rank 0: use 1"),
    (("probe", "--loss", "liger"), "liger"),
    (("run", *CPU, "--gpus", "1", "--engine", "ddp"), "--engine ddp leaves no configuration"),
    (("run", *SIM, "--device", "tpu"), "unknown device 'tpu': use auto, cuda, cpu"),
    (("probe", "--device", "tpu"), "unknown device 'tpu'"),
    (("plan", "--gpu", "h100", "--top", "-5"), "--top -5: use a number of rows"),
    (("plan", "--gpu", "h100", "--reserve", "100GiB"), "--reserve 100.0 GiB is all of the"),
    (("probe", "--micro-batch", "1,,2"), "invalid micro-batch '1,,2'"),
    (("probe", "--micro-batch", "１"), "'１' is a number written in other digits than ASCII's"),
    (("probe", "--model", "tiny", "--ac", "every-999"), "checkpointing every 999 blocks"),
    (("probe", "--device", "cpu", "--study", "../../escape"), "is not a folder name"),
    (("probe", "--device", "cpu", "--study", ".."), "is not a folder name"),
    (("run", *SIM, "--budget", "５m"), "invalid duration '５m'"),
    (("run", *SIM, "--device-memory", "２GiB"), "invalid size '２GiB'"),
    (("run", *SIM, "--headroom", "０.１"), "other digits than ASCII's: write it 0.1"),
    # Each option named as given.
    (("run", *SIM, "--gpus", "0"), "--gpus 0: use 1 or more"),
    (("plan", "--gpu", "h100", "--gpus", "0"), "--gpus 0: use 1 or more"),
    (("probe", "--device", "cpu", "--engine", "ddp", "--gpus", "0"), "--gpus 0: use 1 or more"),
    (("probe", "--device", "cpu", "--gpus", "-1"), "--gpus -1: use 1 or more"),
    (("plan", "--gpu", "h100", "--host-cores", "0"), "--host-cores 0: use 1 or more"),
    (("trials", "--all", "--last", "5"), "--all and --last: give one of them"),
    # The command line itself.
    (("plan", "--device-memory", "1GiB"), "No such option: --device-memory"),
    (("frobnicate",), "No such command 'frobnicate'"),
    (("run", "--budget"), "Option '--budget' requires an argument"),
    (("run", *SIM, "--max-age", "7d"), "--max-age applies to --jobs"),
    (("export", "--format", "yaml"), "unknown export format 'yaml'"),
    # The user's own training script.
    (
        ("run", *CPU, "--script", "missing.py", "--framework", "hf"),
        "the script missing.py does not",
    ),
    (
        ("run", *CPU, "--script", "train.py"),
        "--script needs --framework: hf or accelerate or torchrun",
    ),
    (("run", *CPU, "--script", "train.py", "--framework", "pl"), "unknown framework 'pl'"),
    (("run", *CPU, "--framework", "hf"), "--framework without --script"),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--loss", "chunked"),
        "--loss chunked is a loss of autotune's stand-in; your script computes its own",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--optimizer", "adamw-8bit"),
        "--optimizer adamw-8bit is an optimizer of autotune's stand-in; your script builds",
    ),
    (
        ("probe", *CPU, "--script", "train.py", "--framework", "hf", "--ac", "ops"),
        "--ac ops is autotune's stand-in's checkpointing",
    ),
    (
        ("probe", *CPU, "--script", "train.py", "--framework", "hf", "--compile"),
        "leave out --compile with --script",
    ),
    (
        ("probe", *CPU, "--script", "train.py", "--framework", "hf", "--act-offload"),
        "leave out --act-offload with --script",
    ),
    (("run", *CPU, "--", "--lr", "1"), "arguments after -- without --script"),
    (("run", *CPU[2:], "--script", "train.py", "--framework", "hf"), "give --model with --script"),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--engine", "fsdp"),
        "--framework hf cannot run engine fsdp: use --engine single or ddp or deepspeed",
    ),
    (
        ("run", "--model", "tiny", *SIM, "--script", "train.py", "--framework", "hf"),
        "--script probes your job for real: leave out --simulate",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "torchrun", "--nodes", "2"),
        "--script runs on one node",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--jobs", "j.yaml"),
        "--model and --jobs",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--batch-flag", "--bs"),
        "--batch-flag with --framework hf",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "torchrun", "--batch-flag", "bs"),
        "--batch-flag 'bs' is not a flag",
    ),
    (("run", *CPU, "--batch-flag", "--bs"), "--batch-flag without --script"),
    (("run", *CPU, "--checkpointing-flag", "--ac"), "--checkpointing-flag without --script"),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "torchrun", "--accum-flag", "ga"),
        "--accum-flag 'ga' is not a flag",
    ),
    (
        (
            *("probe", "--device", "cpu", "--script", "train.py", "--framework", "torchrun"),
            *("--accum-flag", "--x", "--checkpointing-flag", "--x"),
        ),
        "one flag named for two knobs",
    ),
    (
        ("run", *CPU, "--script", "train.py", "--framework", "hf", "--accum-flag", "--ga"),
        "--accum-flag with --framework hf: the Trainer's --gradient_accumulation_steps",
    ),
    (("probe", "--device", "cpu", "--framework", "hf"), "--framework without --script"),
    (
        ("probe", "--device", "cpu", "--script", "train.py", "--framework", "hf"),
        "give --model with --script",
    ),
    (
        (
            "probe",
            *CPU,
            "--script",
            "train.py",
            "--framework",
            "hf",
            "--engine",
            "fsdp",
            "--zero-stage",
            "3",
        ),
        "--framework hf cannot run engine fsdp",
    ),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A working folder with model folders of every bad kind, and a good one."""
    configs = {
        "notjson": "{nope",
        "listjson": "[1, 2]",
        "nomodeltype": json.dumps({"hidden_size": 64}),
        "bert": json.dumps(
            {
                "model_type": "bert",
                "architectures": ["BertForMaskedLM"],
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "vocab_size": 30522,
                "intermediate_size": 3072,
                "max_position_embeddings": 512,
            }
        ),
        "t5": json.dumps({"model_type": "t5", "is_encoder_decoder": True, "d_model": 512}),
    }
    for name, text in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    (tmp_path / "empty").mkdir()
    (tmp_path / "train.py").write_text("print('a training script')\n")
    return tmp_path


def snapshot(root: Path) -> dict[str, str]:
    """Every file below ``root`` and a digest of its bytes."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def run_main(
    args: tuple[str, ...],
    cwd: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *,
    take: bool = True,
) -> tuple[int, str]:
    """``autotune ARGS`` through the console entry point, here: its exit code and stderr
    (its stdout stays in ``capsys``)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["autotune", *args])
    umask = os.umask(0)
    os.umask(umask)
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        os.umask(umask)  # the command tightens its own: not this test process's
    return int(done.value.code or 0), capsys.readouterr().err if take else ""


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize(("args", "says"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    folder: Path,
    args: tuple[str, ...],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before = snapshot(folder)
    code, stderr = run_main(args, folder, monkeypatch, capsys)
    assert code == 2, stderr
    assert says in one_line(stderr)
    assert snapshot(folder) == before  # no database, no probe folder, nothing changed


def test_the_command_says_the_same_from_a_fresh_interpreter(folder: Path) -> None:
    """The installed command, as a shell starts it: the same line and exit code."""
    for args, says in (CASES[0], CASES[6], CASES[-2]):
        done = autotune(*args, cwd=folder, env={"CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 2, done.stderr
        assert says in one_line(done.stderr)


def test_an_existing_study_is_left_as_it_was(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input next to a study: the database's bytes do not change."""
    code, stderr = run_main(("run", *SIM, "--budget", "5m", "--json"), folder, monkeypatch, capsys)
    assert code == 0, stderr
    before = snapshot(folder)
    for args in (
        ("--budget", "-5m"),
        ("--device-memory", "1GiB"),
        ("--gpus", "8", "--global-batch", "100"),
    ):
        code, stderr = run_main(("run", *SIM, *args), folder, monkeypatch, capsys)
        assert code == (1 if "1GiB" in args else 2) and one_line(stderr)
    assert snapshot(folder) == before


def test_best_finds_the_study_of_a_model_given_by_path(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``best --model PATH`` and ``export --model PATH`` find the study ``run --model PATH``
    made, whether the path names the folder or its config.json."""
    model = folder / "my-model"
    model.mkdir()
    config = dict(resolve_model("qwen2.5-1.5b").config, architectures=["Qwen2ForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    code, stderr = run_main(
        ("run", "--model", "./my-model", *SIM, "--json"), folder, monkeypatch, capsys
    )
    assert code == 0, stderr
    for given in ("./my-model", str(model), str(model / "config.json"), "my-model"):
        code, _ = run_main(
            ("best", "--model", given, "--json"), folder, monkeypatch, capsys, take=False
        )
        out = capsys.readouterr().out
        assert code == 0, given
        [study] = json.loads(out)
        assert study["study"].startswith("my-model/seq2048/") and study["best"], given


def test_no_gpu_is_said_without_a_traceback_when_cuda_is_hidden(folder: Path) -> None:
    """CUDA_VISIBLE_DEVICES set to nothing hides every GPU: ``run`` says so and writes nothing."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = autotune("run", "--model", "tiny", cwd=folder, env=env)
    assert done.returncode == 2 and "no GPU" in one_line(done.stderr)
    assert not (folder / "trials").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((*SIM, "--device-memory", "1GiB"), "no configuration of llama-7b on 8 GPUs fits 1.00 GiB "
         "per GPU: the smallest, deepspeed z3 off:params ac:every at micro-batch 1, needs"),
        (("--model", "qwen2.5-1.5b", "--device", "cpu", "--device-memory", "1MiB"),
         "no configuration of qwen2.5-1.5b on 1 CPU rank fits 1.00 MiB per rank: "),
        (("--model", "llama3.1-405b", *SIM, "--gpus", "128", "--nodes", "16", "--host-memory",
          "256GiB"), "data-parallel configurations this run searches fits llama3.1-405b on 128 "
         "x h100-80gb, and the best layout that fits, --tp 4 --pp 16 --pp-schedule "
         "interleaved-1f1b --pp-virtual 2, cannot be probed yet: --pp 16 probes one pipeline"),
    ],
    ids=["gpus", "cpu", "layouts-only"],
)  # fmt: skip
def test_a_workload_predicted_to_fit_nothing_exits_1_with_one_line(
    folder: Path,
    args: tuple[str, ...],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Nothing fits (predicted): not a typo but an answer, so exit 1 as a run that found
    nothing that fits (the exit codes of docs/usage.md), one line, nothing written; a CPU run counts
    CPU ranks, not GPUs."""
    before = snapshot(folder)
    code, stderr = run_main(("run", *args), folder, monkeypatch, capsys)
    assert code == 1, stderr
    assert says in one_line(stderr)
    assert snapshot(folder) == before


def test_a_probe_that_would_not_fit_the_host_is_refused_before_it_starts(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``autotune probe`` checks host memory as ``run`` does: qwen2.5-1.5b with ZeRO-3 on the
    CPU under a 40 GiB cap needs more than a 16 GiB node gives, so it is refused at once with
    one line (exit 1, nothing written), where it used to run two minutes into the OOM killer."""
    before = snapshot(folder)
    args = (
        *("probe", "--model", "qwen2.5-1.5b", "--engine", "fsdp", "--zero-stage", "3"),
        *("--device", "cpu", "--device-memory", "40GiB", "--host-memory", "16GiB", "--json"),
    )
    code, stderr = run_main(args, folder, monkeypatch, capsys)
    assert code == 1, stderr
    line = one_line(stderr)
    assert "fsdp z3 ac:off at micro-batch 1 needs" in line and "of host memory" in line
    assert "this node gives the job 12.00 GiB" in line  # 16 GiB less the system's reserve
    assert snapshot(folder) == before

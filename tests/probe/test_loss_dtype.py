"""The dtype a job's loss takes the logits in: seen by the measurement layer, counted by the
estimator's logits term.

``examples/train_torchrun_plain.py`` trains with the model's own loss (transformers' upcasts
the logits to fp32 first) or, with ``--loss-from-logits``, takes ``F.cross_entropy`` of the
logits itself; with ``--bf16`` the model is in bf16 and no autocast runs, the one regime where
the two differ in memory. The term (``LossDtype.LOGITS`` in
``autotune.estimator.activations``) was written on a llama shape of 32,000 tokens of
vocabulary, hidden size 64, 2 blocks, 2 sequences of 512 tokens, one micro-step; the probes
here are of another family and shape (qwen2, 24,576 tokens, hidden 96, 3 blocks, grouped
heads), micro-batch 3 of 128 tokens, accumulating 2 micro-steps (of 32 tokens under autocast,
where only the dtype the layer sees is checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config import Engine, LossDtype, Precision, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.outcome import Outcome
from autotune.probe.scriptprobe import launch_script_probe
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import ScriptJob

PLAIN = Path(__file__).resolve().parents[2] / "examples" / "train_torchrun_plain.py"
FLAGS = {"batch_flag": "--batch-size", "accum_flag": "--grad-accum"}
SHAPE = {
    "model_type": "qwen2",
    "vocab_size": 24576,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
MICRO_BATCH, ACCUMULATION, SEQ_LEN = 3, 2, 128
"""Long enough that the other loss dtype's estimate is far off in pure bf16 (+32 % and -24 %,
measured), short enough that the head's bf16 matmuls (most of a step's) stay short on a CPU
without AVX-512."""
DTYPE_ONLY_SEQ_LEN = 32
"""Tokens a sequence where no peak is checked (under autocast): the dtype is the same at any
length."""


def test_the_loss_dtype_counts_only_where_the_logits_are_16_bit_outside_autocast() -> None:
    """Under autocast ``cross_entropy`` runs in fp32 whatever the job asks, and fp32 logits
    need no copy: the same estimate; in pure bf16 the fp32 copy and fp32 log-probabilities
    are gone (4 bytes a vocabulary entry a token less at the backward's start)."""
    model = resolve_model("qwen2.5-1.5b")
    tokens = 2 * 1024

    def peak(precision: Precision, loss_dtype: LossDtype) -> int:
        return estimate_memory(
            model, TrainConfig(precision=precision), micro_batch_size=2, seq_len=1024,
            cuda_allocator=False, loss_dtype=loss_dtype,
        ).peak_bytes  # fmt: skip

    for precision in (Precision.BF16_MIXED, Precision.FP32):
        assert peak(precision, LossDtype.LOGITS) == peak(precision, LossDtype.FP32)
    saved = peak(Precision.BF16, LossDtype.FP32) - peak(Precision.BF16, LossDtype.LOGITS)
    assert saved == 4 * model.vocab_size * tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "precision", "seen"),
    [
        (("--bf16", "--loss-from-logits"), Precision.BF16, LossDtype.LOGITS),
        (("--bf16",), Precision.BF16, LossDtype.FP32),  # the model's own loss upcasts
        (("--loss-from-logits",), Precision.BF16_MIXED, LossDtype.FP32),  # autocast does
    ],
)
def test_the_layer_sees_the_loss_dtype_and_the_estimate_holds_it(
    tmp_path: Path,
    fork_server: ForkServer,
    args: tuple[str, ...],
    precision: Precision,
    seen: LossDtype,
) -> None:
    """One rank of the plain script, probed as written: the layer reports the dtype its loss
    ran in, and in pure bf16 the estimate with that dtype is within 1 % of the measured peak
    where the other dtype's is over 20 % off. (Under autocast the script's own slice of the
    logits, ``logits[:, :-1]``, is a copy the estimator does not count: the first probe
    calibrates it; there only the dtype is checked, on sequences of DTYPE_ONLY_SEQ_LEN.)"""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPE))
    config = TrainConfig(engine=Engine.SINGLE, precision=precision)
    seq_len = SEQ_LEN if precision is Precision.BF16 else DTYPE_ONLY_SEQ_LEN
    job = ScriptJob.read(
        PLAIN, "torchrun", ("--model", str(folder), "--seq-len", str(seq_len), *args), **FLAGS
    )
    spec = ProbeSpec(
        model=str(folder),
        script=job,
        config=config,
        micro_batch_sizes=(MICRO_BATCH,),
        grad_accum=ACCUMULATION,
        seq_len=seq_len,
        num_processes=1,
        device="cpu",
        warmup_steps=1,
        timed_steps=1,  # a peak: the second step holds the optimizer states, as every later one
        timeout_s=300.0,
    )
    result = launch_script_probe(spec, tmp_path / "probe", warm=fork_server)
    assert result.outcome is Outcome.OK, result.message
    (size,) = result.sizes
    assert size.loss_dtype == seen.value
    if precision is not Precision.BF16:
        return
    model = resolve_model(str(folder))

    def predicted(loss_dtype: LossDtype) -> float:
        estimate = estimate_memory(
            model, config, micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN,
            cuda_allocator=False, grad_accum=ACCUMULATION, loss_dtype=loss_dtype,
        )  # fmt: skip
        return estimate.peak_bytes / (size.peak_bytes or 1) - 1

    other = LossDtype.FP32 if seen is LossDtype.LOGITS else LossDtype.LOGITS
    assert abs(predicted(seen)) < 0.01, predicted(seen)
    assert abs(predicted(other)) > 0.20, predicted(other)

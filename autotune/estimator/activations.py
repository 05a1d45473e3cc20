"""Activation memory of one training step, per token, from the model's shape.

What autograd saves for the backward is a list of tensors whose sizes follow from the model's
dimensions and from the dtype each op runs in; this module writes that list down for the
decoder blocks and the head (final norm, logits, loss) of the causal LMs autotune builds
(llama, mistral, qwen2: RMSNorm, grouped-query attention, SwiGLU; gpt2: LayerNorm, fused qkv,
GELU). Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1) count the same tensors for a GPT block; the counts here follow the Hugging Face
implementations the probes run, op by op, and were checked against the tensors autograd really
saves (docs/estimator.md).

Three dtype regimes change the bytes:

- ``autocast``: fp32 weights under torch.autocast (single and ddp engines, mixed precision).
  The residual stream stays fp32; every linear layer casts its input to bf16 separately (three
  casts before q/k/v, two before gate/up), and the bf16 copy of each weight is kept from the
  layer's forward to its backward.
- ``low``: weights already in bf16/fp16 (FSDP2's mixed-precision policy, DeepSpeed, pure bf16):
  a bf16 residual stream; RMSNorm still computes in fp32 and saves an fp32 copy of its input.
- ``fp32``: everything in fp32.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from autotune.config import (
    LOSS_CHUNK_TOKENS,
    Attention,
    Engine,
    Loss,
    LossDtype,
    Precision,
    TrainConfig,
)
from autotune.models import ModelSpec

__all__ = ["ActivationProfile", "Regime", "activation_profile", "regime_of"]


class Regime(enum.StrEnum):
    """Which dtypes activations take (see the module docstring)."""

    AUTOCAST = "autocast"
    LOW = "low"
    FP32 = "fp32"


def regime_of(config: TrainConfig) -> Regime:
    """The activation dtype regime a configuration trains in (LoRA's frozen weights are kept
    in 16 bits whatever the precision but fp32: ``low``, with autocast where mixed)."""
    if config.precision is Precision.FP32:
        return Regime.FP32
    if (
        config.precision.is_mixed
        and config.engine in (Engine.SINGLE, Engine.DDP)
        and not config.is_lora
    ):
        return Regime.AUTOCAST
    return Regime.LOW


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationProfile:
    """Activation bytes of one model in one regime; ``*_per_token`` scale with batch × seq."""

    regime: Regime
    layer_saved_per_token: float
    """What one decoder block saves for its backward."""
    layer_input_per_token: float
    """What a checkpointed block keeps instead: its input (the residual stream)."""
    layer_selective_per_token: float
    """What a block under op-level selective checkpointing keeps instead: its input and the
    outputs of its matmuls and attention kernel."""
    layer_backward_per_token: float
    """Working set of one block's backward on top of what it saved: gradients of its
    activations (measured; docs/estimator.md)."""
    head_saved_per_token: float
    """Final norm, the lm_head input, the log-softmax output (fp32) and the int64 labels; with
    the chunked loss, the final norm, its output and the shifted labels only."""
    head_forward_per_token: float
    """Extra at the loss, per token of a chunk: the logits and their fp32 upcast (and, chunked,
    the log-probabilities, which the chunk does not keep)."""
    head_backward_per_token: float
    """Extra at the start of the backward, per token of a chunk: gradients of the fp32
    log-probabilities and logits (and, chunked, the recomputed log-probabilities)."""
    head_chunk_tokens: int | None
    """Tokens the loss takes at a time (the two figures above count that many); None: all."""
    head_backward_all_per_token: float = 0.0
    """Chunked loss: the gradient of the whole batch's hidden states, which the chunks'
    backwards fill in turn (all tokens, alive while the chunks run)."""
    head_backward_bytes: int = 0
    """Chunked loss: the output layer's weight gradient of a chunk, in flight in the
    backward while that chunk's transients are alive."""
    head_chunks_of_vocab: int | None = None
    """Fused loss: the chunk is the batch's tokens over this many, rounded up to a power of
    two (Liger-Kernel sizes its logits chunk to about tokens × hidden values)."""
    head_loss_bytes: int = 0
    """Fused loss: the output layer's weight gradient, made in the forward and kept to the
    backward."""

    def loss_chunk(self, tokens: float) -> float:
        """Tokens the loss takes at a time out of a micro-batch of ``tokens``."""
        if self.head_chunks_of_vocab is not None:
            chunk = 1 << max(0, math.ceil(tokens / self.head_chunks_of_vocab) - 1).bit_length()
            return float(min(tokens, chunk))
        if self.head_chunk_tokens is None:
            return tokens
        return float(min(tokens, self.head_chunk_tokens))

    layer_weight_copy_bytes: int
    """Autocast's bf16 copy of one block's weights, held from its forward to its backward
    (under LoRA, of its adapters: the frozen weights are already in 16 bits)."""
    head_weight_copy_bytes: int
    """Autocast's bf16 copy of the lm_head weight."""
    layer_recomputed_per_token: float
    """What a checkpointed block's backward holds of its recomputed forward: what it saves
    (eager), or the eager block's saved set where the block is compiled (its backward graph
    recomputes the forward's intermediates and keeps them for its own backward)."""
    layer_unpacked_per_token: float = 0.0
    """Activation offload: what a block's backward brings back from the host at its peak on
    top of :attr:`layer_backward_per_token` (its saved tensors return one node at a time)."""
    layer_gathered_per_token: float = 0.0
    """What a block saves of the inputs of its q/k/v and gate/up projections (part of
    :attr:`layer_saved_per_token`): under tensor parallelism with sequence parallelism these
    are the all-gathered whole sequence, saved whole on every rank of the group (torch's
    column-split linears keep their input), where the rest of the block's activations are
    split (:mod:`autotune.estimator.parallel`)."""
    first_block_less_per_token: float = 0.0
    """LoRA: what the first block saves less than the others: its first norm's input and
    statistics (the embeddings are frozen, so nothing before the first adapter needs a
    gradient)."""


def _gelu_saved(model: ModelSpec) -> int:
    """Tensors GPT-2's tanh-approximated GELU (``gelu_new``) saves, in units of its input.

    ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))`` is built from elementwise ops, each
    saving an input: x (pow, mul), x**3 (mul), the tanh output, and 0.5·x.
    """
    return 4 if model.activation in ("gelu_new", "gelu_pytorch_tanh") else 1


def activation_profile(
    model: ModelSpec,
    config: TrainConfig,
    seq_len: int,
    loss_dtype: LossDtype = LossDtype.FP32,
) -> ActivationProfile:
    """Activation bytes of ``model`` trained as ``config`` at sequence length ``seq_len``.

    Args:
        model: The model shape.
        config: Supplies the precision/engine (dtype regime) and the attention kernel.
        seq_len: Tokens per sequence; eager attention saves seq × seq scores per head.
        loss_dtype: The dtype the job's loss takes the logits in (the model's own loss:
            fp32); it counts only where the logits are made in 16 bits outside autocast.

    Returns:
        The per-token and per-layer figures the memory timeline adds up.
    """
    regime = regime_of(config)
    d, i, V = model.hidden_size, model.intermediate_size, model.vocab_size
    heads, q = model.num_attention_heads, model.num_attention_heads * model.head_dim
    kv = model.num_key_value_heads * model.head_dim
    gpt2 = model.model_type == "gpt2"
    act = 4 if regime is Regime.FP32 else 2  # bytes of a matmul output
    residual = 2 if regime is Regime.LOW else 4

    # A norm saves its input in fp32 (a copy when the stream is bf16), the per-token
    # statistics, and the normalized tensor the weight multiplies (cast back in `low`).
    normalized = 2 if regime is Regime.LOW else 4
    stats = 8 if gpt2 else 4  # LayerNorm: mean and rstd; RMSNorm: rsqrt
    norm = 4 * d + stats + normalized * d
    # Inputs of the linear layers: one cast copy per layer under autocast, else the norm's
    # output shared by all of them.
    attention_linears, mlp_linears = (1, 1) if gpt2 else (3, 2)
    if regime is Regime.AUTOCAST:
        linear_inputs = 2 * d * (attention_linears + mlp_linears)
    else:
        linear_inputs = 2 * act * d

    if config.attention is not Attention.EAGER:
        # q, k, v after RoPE, the output (also o_proj's input), and the fp32 log-sum-exp: what
        # a flash-type kernel keeps (sdpa's flash, memory-efficient or cuDNN kernel, and
        # flash-attn's: docs/attention.md).
        attention = act * (2 * q + 2 * kv) + 4 * heads
    else:
        # q, k and v expanded to every query head, the fp32 softmax and its cast copy, and
        # o_proj's input, made contiguous.
        probs = 4 * heads * seq_len + (0 if act == 4 else act * heads * seq_len)
        attention = act * 4 * q + probs
    if gpt2:
        attention += act * 3 * d  # the fused c_attn output, split into q, k, v views
        mlp = act * i * (1 + _gelu_saved(model))  # c_fc output, GELU pieces, c_proj input
    else:
        mlp = 4 * act * i  # gate, up, silu(gate), and their product (down_proj's input)

    layer_saved = 2 * norm + linear_inputs + attention + mlp
    recomputed = None  # a checkpointed block's backward: what it saves, unless compiled
    if config.torch_compile and not gpt2 and config.attention is not Attention.EAGER:
        # A compiled block keeps what the min-cut partitioner chooses (listed from the graphs
        # AOT autograd partitions for a llama block, every dtype regime): its input, each
        # norm's statistics and output (the q/k/v and gate/up projections share one), q and k
        # after RoPE, v, the attention kernel's output and log-sum-exp, o_proj's input (its own
        # copy) and output (the second norm's input is rebuilt from it), gate, up and their
        # product; the norms' fp32 inputs and silu(gate) are recomputed in the backward.
        recomputed = layer_saved
        layer_saved = residual * d + 2 * stats + 4 * heads + act * (3 * d + 3 * q + 2 * kv + 3 * i)
    # Op-level selective checkpointing keeps the block's input and every output of the ops it
    # saves (autotune.config.SELECTIVE_SAVED_OPS): the q, k, v, o projections, the MLP's
    # matmuls (gate, up, down; GPT-2: c_fc, c_proj) and the attention kernel's output and
    # fp32 log-sum-exp. Eager attention's score matmuls are saved too.
    projections = 3 * d + d + i + d if gpt2 else q + 2 * kv + d + 2 * i + d
    matmul_outputs = act * projections
    if config.attention is not Attention.EAGER:
        kernel_outputs = act * q + 4 * heads
    else:
        kernel_outputs = act * (heads * seq_len + q)  # the scores and the weighted values
    selective = residual * d + matmul_outputs + kernel_outputs
    # The final norm, the lm_head's input, the fp32 log-probabilities and two int64 copies of
    # the labels (inputs and shifted targets).
    head_input = 2 * d if regime is Regime.AUTOCAST else act * d
    head_saved = norm + head_input + 4 * V + 16
    logits = act * V + (4 * V if act != 4 else 0)  # the lm_head output and its fp32 upcast
    # Under autocast the final norm's fp32 output lives on in the returned model output.
    head_forward = logits + (4 * d if regime is Regime.AUTOCAST else 0) + 8
    head_backward = 8 * V
    if loss_dtype is LossDtype.LOGITS and regime is Regime.LOW and config.loss is Loss.FULL:
        # The log-softmax in the logits' dtype: no fp32 copy, its output (kept for the
        # backward) and both gradients in 16 bits; the job made the loss from logits it
        # still holds (a plain loop's variable) through the backward.
        head_saved = norm + head_input + act * V + 16
        head_forward = act * V + 8
        head_backward = 3 * act * V
    chunk = None
    head_backward_all, head_weight_grad = 0, 0
    if config.loss is Loss.CHUNKED:
        # Each chunk keeps only its inputs: its slice of the final norm's output (the residual
        # stream's dtype) and of the shifted int64 labels. Its logits, upcast and
        # log-probabilities exist while it runs, and again, recomputed, in the backward.
        head_saved = norm + residual * d + 8
        head_forward = logits + 4 * V
        head_backward = 4 * V + 8 * V
        chunk = LOSS_CHUNK_TOKENS
        head_backward_all = residual * d
        head_weight_grad = act * V * d
    chunks_of_vocab, loss_bytes = None, 0
    if config.loss is Loss.FUSED:
        # Liger-Kernel's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy
        # .py, 0.8.5): in the forward, chunk by chunk, the logits in the input's dtype (the
        # matmul's under autocast), the loss and both gradients; it keeps the gradient of the
        # hidden states (their dtype) and of the weight (the weight's dtype: fp32 masters
        # under autocast) for the backward, and an fp32 loss a token. The chunk is
        # next_power_of_2(ceil(tokens / ceil(V / d))) tokens: about tokens x d logits.
        head_saved = norm + residual * d + 4
        head_forward = act * V
        head_backward = 0
        chunks_of_vocab = -(-V // d)
        weight = 4 if regime is not Regime.LOW else 2
        loss_bytes = weight * V * d

    matmul_per_layer = model.num_block_params // model.num_layers
    copies = regime is Regime.AUTOCAST
    first_less = 0.0
    if config.is_lora:
        # Frozen weights (Hu et al. 2021) need no saved input for a weight gradient, and peft
        # computes each adapter beside its layer: ``lora_B(lora_A(x)) * alpha / r``, the input
        # first cast to the adapters' fp32 (peft's ``_cast_input_dtype``; autocast casts it to
        # bf16 again). What changes against full fine-tuning, per token (counted with
        # saved-tensor hooks on a tiny llama in fp32, pure bf16 and under autocast):
        # - each norm keeps its input and statistics, not the normalized tensor the frozen
        #   weight multiplies; the output layer's input is not kept at all;
        # - in 16 bits, each adapted layer keeps its own cast copy of its input (fp32, or bf16
        #   under autocast) where full fine-tuning keeps the norms' outputs and the MLP
        #   product once; in fp32 the adapters read the very tensors full fine-tuning keeps;
        # - each adapter keeps A's output (r values) for B, in the adapters' compute dtype;
        # - the embedding's token ids are not kept (one int64 a token less).
        rank = config.lora_rank
        ins = sum(i_ for i_, _ in model.block_linears)
        adapters = len(model.block_linears)
        mixed = config.precision.is_mixed
        lora_act = 2 if mixed else 4  # A's output: autocast's bf16, or the adapters' fp32
        frozen_norm = 4 * d + stats
        layer_saved -= 2 * (norm - frozen_norm)
        if regime is not Regime.FP32:
            kernel_keeps_output = config.attention is not Attention.EAGER
            layer_saved -= linear_inputs + act * i + (0 if kernel_keeps_output else act * q)
            layer_saved += lora_act * ins
        layer_saved += adapters * rank * lora_act
        head_saved -= head_input + 8 + (norm - frozen_norm)
        first_less = float(frozen_norm)
        matmul_per_layer = model.lora_block_params(rank)
        copies = mixed
        head_copy = False
    else:
        head_copy = copies
    return ActivationProfile(
        regime=regime,
        layer_saved_per_token=layer_saved,
        layer_input_per_token=residual * d,
        layer_gathered_per_token=linear_inputs,
        layer_selective_per_token=selective,
        layer_backward_per_token=9 * d + 2 * i,
        layer_unpacked_per_token=max(0, 5 * act * i - (9 * d + 2 * i)),
        layer_recomputed_per_token=layer_saved if recomputed is None else recomputed,
        head_saved_per_token=head_saved,
        head_forward_per_token=head_forward,
        head_backward_per_token=head_backward,
        head_chunk_tokens=chunk,
        head_backward_all_per_token=head_backward_all,
        head_backward_bytes=head_weight_grad,
        head_chunks_of_vocab=chunks_of_vocab,
        head_loss_bytes=loss_bytes,
        layer_weight_copy_bytes=2 * matmul_per_layer if copies else 0,
        head_weight_copy_bytes=2 * V * d if head_copy else 0,
        first_block_less_per_token=first_less,
    )

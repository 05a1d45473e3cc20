"""A model shape as plain data: its ``config.json`` fields and the numbers derived from them.

The search and the estimator only need parameter and FLOP counts, computed here from the fields
alone; the probes build the real model from the same fields on the torch side
(:func:`autotune.probe.modeling.hf_config`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar, cast

from autotune.models.families import Counts, Shape, count_params, read_shape

_T = TypeVar("_T")

__all__ = ["ModelSpec"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model shape: a causal LM's ``config.json`` fields plus the numbers the tuner derives.

    Two specs are equal when their names and fields are; the hash is the name's.
    """

    name: str
    """Preset name, or the folder name of a loaded ``config.json``."""
    config: Mapping[str, Any] = field(hash=False, repr=False)
    """The ``config.json`` fields, ``model_type`` included, read-only (a private copy of what
    was given). Fields a family's config class fills in by default may be left out."""
    _memo: dict[str, Any] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )
    """Derived numbers, computed once: the estimator reads them thousands of times per plan."""

    def __post_init__(self) -> None:
        fields = copy.deepcopy(dict(self.config))
        model_type = fields.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(f"model config of {self.name!r} has no model_type")
        # A copy behind a read-only view: derived numbers are memoized, so the fields must not
        # change under them.
        object.__setattr__(self, "config", MappingProxyType(fields))

    def config_dict(self) -> dict[str, Any]:
        """A deep, mutable copy of the ``config.json`` fields."""
        return copy.deepcopy(dict(self.config))

    def with_layers(self, layers: int) -> ModelSpec:
        """This spec with ``layers`` decoder blocks, per-layer type lists cut or repeated to fit.

        Args:
            layers: The number of decoder blocks, at least 1.

        Returns:
            A spec of the same name and family.

        Raises:
            ValueError: If ``layers`` is below 1.
        """
        if layers < 1:
            raise ValueError(f"layers {layers} must be >= 1")
        fields = self.config_dict()
        if self.model_type == "gpt2":
            fields.pop("num_hidden_layers", None)  # it would win over n_layer
            fields["n_layer"] = layers
        else:
            fields["num_hidden_layers"] = layers
        layer_types = fields.get("layer_types")
        if isinstance(layer_types, list | tuple) and layer_types:
            fields["layer_types"] = [layer_types[i % len(layer_types)] for i in range(layers)]
        return ModelSpec(name=self.name, config=fields)

    def _memoized(self, key: str, compute: Callable[[], _T]) -> _T:
        if key not in self._memo:
            self._memo[key] = compute()
        return cast(_T, self._memo[key])

    def _shape(self) -> Shape:
        return self._memoized("shape", lambda: read_shape(self.config))

    @property
    def model_type(self) -> str:
        """The transformers ``model_type`` (``llama``, ``qwen2``, ``gpt2``...)."""
        return str(self.config["model_type"])

    @property
    def num_layers(self) -> int:
        """Number of decoder blocks L."""
        return self._shape().num_layers

    @property
    def hidden_size(self) -> int:
        """Residual stream width d."""
        return self._shape().hidden_size

    @property
    def num_attention_heads(self) -> int:
        """Query heads H."""
        return self._shape().num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads (fewer than H with grouped-query attention)."""
        return self._shape().num_key_value_heads

    @property
    def head_dim(self) -> int:
        """Per-head width Q."""
        return self._shape().head_dim

    @property
    def intermediate_size(self) -> int:
        """MLP hidden width (gpt2: ``n_inner``, default 4d)."""
        return self._shape().intermediate_size

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding table."""
        return self._shape().vocab_size

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the lm_head shares its weight with the input token table."""
        return self._shape().tie_word_embeddings

    @property
    def max_position_embeddings(self) -> int:
        """Longest sequence the model accepts."""
        return self._shape().max_position_embeddings

    @property
    def activation(self) -> str:
        """The MLP's activation function (``hidden_act``; gpt2: ``activation_function``)."""
        return self._shape().activation

    def _counts(self) -> Counts:
        return self._memoized("counts", lambda: count_params(self.config, self._shape()))

    @property
    def num_params(self) -> int:
        """Distinct trainable parameters, equal to ``sum(p.numel())`` of the built model."""
        return self._counts().total

    @property
    def parameter_tensors(self) -> tuple[tuple[int, int], ...]:
        """(values, how many) of each size of parameter tensor, a tied table once."""
        return self._counts().tensors

    @property
    def block_linears(self) -> tuple[tuple[int, int], ...]:
        """(in features, out features) of each linear layer of one decoder block."""
        return self._counts().linears

    def lora_block_params(self, rank: int) -> int:
        """LoRA adapter parameters of one block at ``rank``: r·(in + out) for each linear
        layer (its A, r × in, and its B, out × r)."""
        return rank * sum(i + o for i, o in self.block_linears)

    def lora_params(self, rank: int) -> int:
        """LoRA adapter parameters of the whole model at ``rank`` (every block's)."""
        return self.lora_block_params(rank) * self.num_layers

    @property
    def num_embedding_params(self) -> int:
        """Input token table plus learned position table: lookups that do no matmul."""
        return self._counts().embedding

    @property
    def num_block_params(self) -> int:
        """Parameters inside the decoder blocks."""
        return self._counts().blocks

    @property
    def num_matmul_params(self) -> int:
        """Parameters in a matmul for every token: N - N_emb, plus a tied head.

        A tied table is counted once in N and removed as an embedding, yet still does the lm_head
        matmul (2·V·d FLOPs per token), so it is added back.
        """
        counts = self._counts()
        tied_head = self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0
        return counts.total - counts.embedding + tied_head

    def _attention_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of the score and value matmuls: 2·2·L·H·Q·T."""
        return 4.0 * self.num_layers * self.num_attention_heads * self.head_dim * seq_len

    def flops_per_token(
        self, seq_len: int, *, recompute: bool = False, lora_rank: int = 0
    ) -> float:
        """Training FLOPs per token (forward + backward).

        6·N_matmul + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B), without the embedding
        lookups as in torchtitan's MFU accounting; attention counts as non-causal, as in PaLM.
        With LoRA the frozen weights make no weight gradient: 4·N_matmul + 6·N_adapters +
        12·L·H·Q·T, what that training needs (its MFU is counted on it, not on 6·N).

        Args:
            seq_len: Tokens per sequence T.
            recompute: Return the hardware FLOPs of full activation checkpointing instead,
                ``hardware_flops_per_token(seq_len, 1.0)``, about 8·N + 16·L·H·Q·T.
            lora_rank: LoRA's rank; 0 for full fine-tuning.

        Returns:
            FLOPs per token.
        """
        if recompute:
            return self.hardware_flops_per_token(seq_len, 1.0, lora_rank=lora_rank)
        matmuls = 6.0 * self.num_matmul_params
        if lora_rank:
            matmuls = 4.0 * self.num_matmul_params + 6.0 * self.lora_params(lora_rank)
        return matmuls + 3.0 * self._attention_flops(seq_len)

    def hardware_flops_per_token(
        self,
        seq_len: int,
        checkpointed_fraction: float,
        *,
        head_recomputed: bool = False,
        lora_rank: int = 0,
    ) -> float:
        """FLOPs the GPU executes per token when a fraction of blocks is recomputed.

        Recomputing a block repeats its forward pass: 2·N_block + 4·L·H·Q·T, scaled by the
        fraction checkpointed.  The lm_head is not recomputed: Narayanan et al. 2021 ("Efficient
        Large-Scale Language Model Training on GPU Clusters", appendix) give 4 passes to the
        blocks but 3 to the logit layer: 96·B·s·l·h²·(1 + s/6h + V/16lh).

        Args:
            seq_len: Tokens per sequence T.
            checkpointed_fraction: Fraction of decoder blocks recomputed, 0 (none) to 1 (all).
            head_recomputed: The logit layer's forward runs again in the backward (the chunked
                loss): 2·H·V more.
            lora_rank: LoRA's rank (:meth:`flops_per_token`; a recomputed block runs its
                adapters' forward again too); 0 for full fine-tuning.

        Returns:
            FLOPs per token.

        Raises:
            ValueError: If the fraction lies outside [0, 1].
        """
        if not 0.0 <= checkpointed_fraction <= 1.0:
            raise ValueError(f"checkpointed_fraction {checkpointed_fraction} is not in [0, 1]")
        extra = 2.0 * self.num_block_params + self._attention_flops(seq_len)
        if lora_rank:
            extra += 2.0 * self.lora_params(lora_rank)
        head = 2.0 * self.hidden_size * self.vocab_size if head_recomputed else 0.0
        flops = self.flops_per_token(seq_len, lora_rank=lora_rank)
        return flops + checkpointed_fraction * extra + head

"""Named model shapes, analytic parameter counts and FLOPs per token.

A :class:`ModelSpec` wraps a Hugging Face ``PretrainedConfig``: probes build the real model from
it, while the search only needs parameter and FLOP counts, computed here from the config alone.
Presets carry the published shapes of the real checkpoints and are built offline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

_T = TypeVar("_T")

__all__ = ["ModelSpec", "preset_names", "resolve_model", "synthetic_batch"]

# Families whose parameter count is derived analytically below; any other causal LM falls back to
# counting a model built on the meta device (exact, but about a second for a 7B model).
_LLAMA_STYLE = frozenset({"llama", "mistral", "qwen2"})


@dataclass(frozen=True, kw_only=True, slots=True)
class _Counts:
    """Parameter counts of one model, split by the role the parameters play in a step."""

    total: int
    """All distinct parameters; a tied head shares the input table and is counted once."""
    embedding: int
    """Input token table plus learned position table: lookups, no matmul."""
    blocks: int
    """Parameters inside the decoder blocks (what activation checkpointing recomputes)."""


def _llama_counts(cfg: PretrainedConfig) -> _Counts:
    """Count a llama/mistral/qwen2 model: GQA attention, gated SwiGLU MLP, RMSNorm."""
    d, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim = cfg.num_attention_heads * _head_dim(cfg)
    kv_dim = _kv_heads(cfg) * _head_dim(cfg)
    attention = d * q_dim + 2 * d * kv_dim + q_dim * d
    if cfg.model_type == "qwen2":
        # Qwen2 always has biases on q/k/v but not on o_proj (modeling_qwen2.Qwen2Attention).
        attention += q_dim + 2 * kv_dim
    elif getattr(cfg, "attention_bias", False):
        attention += q_dim + 2 * kv_dim + d  # llama's flag puts a bias on all four projections
    mlp = 3 * d * inter
    if getattr(cfg, "mlp_bias", False):
        mlp += 2 * inter + d
    block = attention + mlp + 2 * d  # two RMSNorm weight vectors, no bias
    embedding = vocab * d
    blocks = cfg.num_hidden_layers * block
    head = 0 if cfg.tie_word_embeddings else vocab * d
    return _Counts(total=embedding + blocks + d + head, embedding=embedding, blocks=blocks)


def _gpt2_counts(cfg: PretrainedConfig) -> _Counts:
    """Count a GPT-2 model: learned positions, fused qkv with bias, LayerNorm with bias."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    inter = cfg.n_inner or 4 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn, c_proj (Conv1D with bias)
    mlp = (d * inter + inter) + (inter * d + d)  # c_fc, c_proj
    block = attention + mlp + 2 * 2 * d  # ln_1, ln_2: weight and bias
    embedding = vocab * d + cfg.max_position_embeddings * d
    blocks = cfg.num_hidden_layers * block
    head = 0 if cfg.tie_word_embeddings else vocab * d
    return _Counts(total=embedding + blocks + 2 * d + head, embedding=embedding, blocks=blocks)


_META_COUNTS: dict[str, _Counts] = {}


def _meta_counts(cfg: PretrainedConfig) -> _Counts:
    """Count any causal LM by building it on the meta device (no memory, no weights)."""
    key = cfg.to_json_string(use_diff=False)
    if key not in _META_COUNTS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        total = sum(p.numel() for p in model.parameters())
        modules = list(model.modules())
        embeddings = [m for m in modules if isinstance(m, torch.nn.Embedding)]
        tables = {id(m.weight): m.weight.numel() for m in embeddings}  # tied tables count once
        # The decoder stack is the ModuleList with one entry per layer.
        depth = cfg.num_hidden_layers
        stacks = [m for m in modules if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
        blocks = max((sum(p.numel() for p in s.parameters()) for s in stacks), default=0)
        _META_COUNTS[key] = _Counts(total=total, embedding=sum(tables.values()), blocks=blocks)
    return _META_COUNTS[key]


def _head_dim(cfg: PretrainedConfig) -> int:
    """Per-head width: the explicit ``head_dim`` when the config has one, else d / heads."""
    explicit = getattr(cfg, "head_dim", None)
    return int(explicit) if explicit else cfg.hidden_size // cfg.num_attention_heads


def _kv_heads(cfg: PretrainedConfig) -> int:
    """Key/value heads; configs without GQA (gpt2) use one per query head."""
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


@dataclass(frozen=True, slots=True)
class _Dims:
    """The shape numbers of a config, read once (transformers config reads are slow)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


def _read_dims(cfg: PretrainedConfig) -> _Dims:
    hidden = int(cfg.hidden_size)
    # gpt2 names its MLP width n_inner, default 4d.
    intermediate = getattr(cfg, "intermediate_size", None)
    if intermediate is None:
        intermediate = getattr(cfg, "n_inner", None) or 4 * hidden
    return _Dims(
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=hidden,
        num_attention_heads=int(cfg.num_attention_heads),
        num_key_value_heads=_kv_heads(cfg),
        head_dim=_head_dim(cfg),
        intermediate_size=int(intermediate),
        vocab_size=int(cfg.vocab_size),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model shape: a Hugging Face config plus the derived numbers the tuner needs."""

    name: str
    """Preset name, or the folder name of a loaded ``config.json``."""
    hf_config: PretrainedConfig = field(compare=False, hash=False, repr=False)
    """The transformers config the probes build the model from (``use_cache=False``); not to be
    changed once the spec exists (derived numbers are memoized)."""
    _memo: dict[str, Any] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )
    """Derived numbers, computed once: reading a transformers config attribute is slow, and the
    estimator reads them thousands of times per plan."""

    def _memoized(self, key: str, compute: Callable[[], _T]) -> _T:
        if key not in self._memo:
            self._memo[key] = compute()
        return cast(_T, self._memo[key])

    def _dims(self) -> _Dims:
        return self._memoized("dims", lambda: _read_dims(self.hf_config))

    @property
    def model_type(self) -> str:
        """The transformers ``model_type`` (``llama``, ``qwen2``, ``gpt2``...)."""
        return self._memoized("model_type", lambda: str(self.hf_config.model_type))

    @property
    def num_layers(self) -> int:
        """Number of decoder blocks L."""
        return self._dims().num_layers

    @property
    def hidden_size(self) -> int:
        """Residual stream width d."""
        return self._dims().hidden_size

    @property
    def num_attention_heads(self) -> int:
        """Query heads H."""
        return self._dims().num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads (fewer than H with grouped-query attention)."""
        return self._dims().num_key_value_heads

    @property
    def head_dim(self) -> int:
        """Per-head width Q."""
        return self._dims().head_dim

    @property
    def intermediate_size(self) -> int:
        """MLP hidden width (gpt2: ``n_inner``, default 4d)."""
        return self._dims().intermediate_size

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding table."""
        return self._dims().vocab_size

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the lm_head shares its weight with the input token table."""
        return bool(self.hf_config.tie_word_embeddings)

    @property
    def max_position_embeddings(self) -> int:
        """Longest sequence the model accepts."""
        return int(self.hf_config.max_position_embeddings)

    def _counts(self) -> _Counts:
        return self._memoized("counts", self._count)

    def _count(self) -> _Counts:
        if self.model_type in _LLAMA_STYLE:
            return _llama_counts(self.hf_config)
        if self.model_type == "gpt2":
            return _gpt2_counts(self.hf_config)
        return _meta_counts(self.hf_config)

    @property
    def num_params(self) -> int:
        """Distinct trainable parameters, equal to ``sum(p.numel())`` of the built model."""
        return self._counts().total

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

    def flops_per_token(self, seq_len: int, *, recompute: bool = False) -> float:
        """Training FLOPs per token (forward + backward).

        6·N_matmul + 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, appendix B), without the embedding
        lookups as in torchtitan's MFU accounting; attention counts as non-causal, as in PaLM.

        Args:
            seq_len: Tokens per sequence T.
            recompute: Return the hardware FLOPs of full activation checkpointing instead,
                ``hardware_flops_per_token(seq_len, 1.0)``, about 8·N + 16·L·H·Q·T.

        Returns:
            FLOPs per token.
        """
        if recompute:
            return self.hardware_flops_per_token(seq_len, 1.0)
        return 6.0 * self.num_matmul_params + 3.0 * self._attention_flops(seq_len)

    def hardware_flops_per_token(self, seq_len: int, checkpointed_fraction: float) -> float:
        """FLOPs the GPU executes per token when a fraction of blocks is recomputed.

        Recomputing a block repeats its forward pass: 2·N_block + 4·L·H·Q·T, scaled by the
        fraction checkpointed.  The lm_head is not recomputed: Narayanan et al. 2021 ("Efficient
        Large-Scale Language Model Training on GPU Clusters", appendix) give 4 passes to the
        blocks but 3 to the logit layer: 96·B·s·l·h²·(1 + s/6h + V/16lh).

        Args:
            seq_len: Tokens per sequence T.
            checkpointed_fraction: Fraction of decoder blocks recomputed, 0 (none) to 1 (all).

        Returns:
            FLOPs per token.

        Raises:
            ValueError: If the fraction lies outside [0, 1].
        """
        if not 0.0 <= checkpointed_fraction <= 1.0:
            raise ValueError(f"checkpointed_fraction {checkpointed_fraction} is not in [0, 1]")
        extra = 2.0 * self.num_block_params + self._attention_flops(seq_len)
        return self.flops_per_token(seq_len) + checkpointed_fraction * extra


# Presets: shapes from each checkpoint's config.json on the Hugging Face Hub (meta-llama/Llama-2-
# 7b-hf, -13b-hf and -70b-hf, Meta-Llama-3-8B, mistralai/Mistral-7B-v0.3, Qwen/Qwen2.5-1.5B and
# -7B, openai-community/gpt2).


def _rope(theta: float) -> dict[str, Any]:
    """RoPE base as a keyword transformers 4.x takes and 5.x folds into ``rope_parameters``."""
    return {"rope_theta": theta}


# Test shapes: a few kB of weights, still with GQA (4 query heads sharing 2 kv heads).
_TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "use_cache": False,
}  # fmt: skip

# Every preset builds with use_cache=False: probes train, and a KV cache would only hold memory
# that the search then attributes to the configuration.
_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-7b": partial(
        transformers.LlamaConfig, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, use_cache=False,
    ),
    "llama-13b": partial(
        transformers.LlamaConfig, vocab_size=32000, hidden_size=5120, intermediate_size=13824,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        max_position_embeddings=4096, rms_norm_eps=1e-5, use_cache=False,
    ),
    "llama-70b": partial(
        transformers.LlamaConfig, vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        max_position_embeddings=4096, rms_norm_eps=1e-5, use_cache=False,
    ),
    "llama3-8b": partial(
        transformers.LlamaConfig, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, **_rope(500000.0), rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_id=128001, use_cache=False,
    ),
    # v0.2 onward dropped the 4096-token sliding window of v0.1 and raised rope_theta to 1e6.
    "mistral-7b": partial(
        transformers.MistralConfig, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, sliding_window=None, **_rope(1000000.0),
        rms_norm_eps=1e-5, use_cache=False,
    ),
    "qwen2.5-1.5b": partial(
        transformers.Qwen2Config, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, **_rope(1000000.0),
        rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643, use_cache=False,
    ),
    "qwen2.5-7b": partial(
        transformers.Qwen2Config, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, tie_word_embeddings=False, **_rope(1000000.0),
        rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643, use_cache=False,
    ),
    "gpt2": partial(
        transformers.GPT2Config, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
        n_head=12, use_cache=False,
    ),
    "tiny": partial(transformers.LlamaConfig, **_TINY),
    "tiny-gpt2": partial(
        transformers.GPT2Config, vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=255, eos_token_id=255, use_cache=False,
    ),
    # Tied like the small Qwen2.5 models, so tests cover the tied-head and qkv-bias paths.
    "tiny-qwen": partial(
        transformers.Qwen2Config, **_TINY, tie_word_embeddings=True, use_sliding_window=False
    ),
}  # fmt: skip


def preset_names() -> list[str]:
    """Names accepted by :func:`resolve_model` besides config paths."""
    return list(_PRESETS)


def _load_config(path: Path) -> PretrainedConfig:
    """Load a local ``config.json`` (file or its folder) and check it is a causal LM."""
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load model config from '{path}': {first_line}") from exc
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model config '{path}' is a {config.model_type!r}, not a causal LM")
    config.use_cache = False  # as in the presets
    return config


def resolve_model(name_or_path: str) -> ModelSpec:
    """Turn a preset name or a path to a Hugging Face ``config.json`` into a :class:`ModelSpec`.

    Args:
        name_or_path: A name from :func:`preset_names`, a ``config.json`` file, or a folder that
            holds one.  Hub ids are not fetched: this tool runs on offline training nodes.

    Returns:
        The spec; for a path, named after the folder holding the config.

    Raises:
        ValueError: For an unknown name, or a config that cannot be loaded as a causal LM.
    """
    if name_or_path in _PRESETS:
        return ModelSpec(name=name_or_path, hf_config=_PRESETS[name_or_path]())
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return ModelSpec(name=path.resolve().parent.name, hf_config=_load_config(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec(name=path.resolve().name, hf_config=_load_config(path))
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {', '.join(_PRESETS)}, "
        "or a path to a config.json"
    )


def synthetic_batch(
    spec: ModelSpec,
    micro_batch_size: int,
    seq_len: int,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Random token ids for a probe step, the same for the same seed on every machine.

    The ids are drawn on the CPU generator and then moved, because CUDA generators give other
    numbers for the same seed and would make probes on different GPUs see different data.

    Args:
        spec: The model whose vocabulary bounds the ids.
        micro_batch_size: Sequences per micro-batch.
        seq_len: Tokens per sequence.
        seed: Generator seed.
        device: Where the returned tensor lives.

    Returns:
        An int64 tensor of shape ``(micro_batch_size, seq_len)``.

    Raises:
        ValueError: If a size is not positive or ``seq_len`` exceeds the model's context.
    """
    if micro_batch_size < 1 or seq_len < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size} and seq_len {seq_len} must be >= 1")
    if seq_len > spec.max_position_embeddings:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {spec.max_position_embeddings} positions "
            f"model {spec.name!r} supports (max_position_embeddings)"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (micro_batch_size, seq_len)
    return torch.randint(0, spec.vocab_size, shape, generator=generator).to(device)

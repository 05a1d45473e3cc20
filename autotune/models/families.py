"""Shape numbers and parameter counts of a model config, read without torch where possible.

llama, mistral, qwen2 and gpt2 (the analytic families) are read from the ``config.json`` fields
alone. A saved ``config.json`` may leave fields out (``save_pretrained`` writes only those that
differ from the config class's defaults), so the defaults transformers' config classes fill in
are written down here per family, along with gpt2's own field names. Their parameter counts
are derived in closed form.

Any other causal LM is read through transformers itself and counted by building it on the meta
device; torch and transformers are imported only then, inside the functions that need them.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "ANALYTIC_FAMILIES",
    "Counts",
    "Shape",
    "count_params",
    "read_shape",
    "transformers_config",
]

_LLAMA_STYLE = frozenset({"llama", "mistral", "qwen2"})

ANALYTIC_FAMILIES: frozenset[str] = _LLAMA_STYLE | {"gpt2"}
"""``model_type`` values read and counted without torch or transformers."""

# The defaults of transformers' LlamaConfig, MistralConfig, Qwen2Config and GPT2Config for the
# fields a shape depends on, as of transformers 5 (tests/test_model_config_file.py checks them
# against the installed version). None: derived from other fields (key/value heads: one per
# query head; head width: d / heads; gpt2's MLP: 4d).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "head_dim": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": None, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "gpt2": {
        "vocab_size": 50257, "n_embd": 768, "n_inner": None, "n_layer": 12, "n_head": 12,
        "n_positions": 1024, "tie_word_embeddings": True, "activation_function": "gelu_new",
        "add_cross_attention": False,
    },
}  # fmt: skip

# GPT2Config stores these under its own names and maps the common names onto them; a common name
# given explicitly wins, as in GPT2Config itself.
_GPT2_NAMES: dict[str, str] = {
    "hidden_size": "n_embd",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "n_positions",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """The numbers of a config that the counts, FLOPs and estimators use."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    activation: str
    """Name of the MLP's activation function (``silu``, ``gelu_new``...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Counts:
    """Parameter counts of one model, split by the role the parameters play in a step."""

    total: int
    """All distinct parameters; a tied head shares the input table and is counted once."""
    embedding: int
    """Input token table plus learned position table: lookups, no matmul."""
    blocks: int
    """Parameters inside the decoder blocks (what activation checkpointing recomputes)."""
    tensors: tuple[tuple[int, int], ...] = ()
    """(values, how many) of each size of parameter tensor, a tied table once: an 8-bit
    optimizer quantizes the large tensors and leaves the small ones (norms, biases) whole."""
    linears: tuple[tuple[int, int], ...] = ()
    """(in features, out features) of each linear layer of one decoder block, in order: what
    LoRA adapts (:data:`autotune.config.LORA_TARGETS`)."""


def _field(config: Mapping[str, Any], name: str) -> Any:
    """A field of an analytic family's config, or the family default when it is left out."""
    model_type = config["model_type"]
    if name in config:
        return config[name]
    alias = _GPT2_NAMES.get(name) if model_type == "gpt2" else None
    if alias is not None and alias in config:
        return config[alias]
    return _DEFAULTS[model_type].get(alias or name)


def _positive(name: str, value: Any) -> int:
    # bool is an int subclass, and a float such as 64.0 would hide a malformed file.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value


def read_shape(config: Mapping[str, Any]) -> Shape:
    """The shape numbers of a config given as its ``config.json`` fields.

    Args:
        config: The fields, ``model_type`` included.

    Returns:
        The shape; for a family outside :data:`ANALYTIC_FAMILIES`, read through transformers.

    Raises:
        ValueError: If a field the shape needs has the wrong type or is not positive.
    """
    model_type = config["model_type"]
    if model_type not in ANALYTIC_FAMILIES:
        return _shape_of(transformers_config(config))
    ints = {
        name: _positive(name, _field(config, name))
        for name in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
            "max_position_embeddings",
        )
    }  # fmt: skip
    hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
    if model_type == "gpt2":
        kv_heads, head_dim = heads, hidden // heads
        inner = _field(config, "n_inner")
        intermediate = 4 * hidden if inner is None else _positive("n_inner", inner)
        activation = _field(config, "activation_function")
    else:
        kv = _field(config, "num_key_value_heads")
        kv_heads = heads if kv is None else _positive("num_key_value_heads", kv)
        # All three take an explicit head_dim when it is set and d / heads otherwise.
        explicit = _field(config, "head_dim")
        head_dim = hidden // heads if explicit is None else _positive("head_dim", explicit)
        intermediate = _positive("intermediate_size", _field(config, "intermediate_size"))
        activation = _field(config, "hidden_act")
    return Shape(
        num_layers=ints["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=ints["vocab_size"],
        tie_word_embeddings=_flag("tie_word_embeddings", _field(config, "tie_word_embeddings")),
        max_position_embeddings=ints["max_position_embeddings"],
        activation=str(activation),
    )


def count_params(config: Mapping[str, Any], shape: Shape) -> Counts:
    """Parameter counts of the causal LM of ``config``, whose shape is ``shape``.

    Args:
        config: The ``config.json`` fields, ``model_type`` included.
        shape: :func:`read_shape` of ``config``.

    Returns:
        The counts, equal to those of the model transformers builds from the config.
    """
    model_type = config["model_type"]
    if model_type in _LLAMA_STYLE:
        return _llama_counts(config, shape)
    # Cross-attention blocks are an encoder-decoder option the closed form leaves out.
    if model_type == "gpt2" and not _field(config, "add_cross_attention"):
        return _gpt2_counts(shape)
    return _meta_counts(transformers_config(config))


def _llama_counts(config: Mapping[str, Any], shape: Shape) -> Counts:
    """Count a llama/mistral/qwen2 model: GQA attention, gated SwiGLU MLP, RMSNorm."""
    d, inter, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q_dim = shape.num_attention_heads * shape.head_dim
    kv_dim = shape.num_key_value_heads * shape.head_dim
    attention = d * q_dim + 2 * d * kv_dim + q_dim * d
    mlp = 3 * d * inter
    model_type = config["model_type"]
    if model_type == "qwen2":
        # Qwen2 always has biases on q/k/v but not on o_proj (modeling_qwen2.Qwen2Attention).
        attention += q_dim + 2 * kv_dim
    elif model_type == "llama":
        # Only llama reads these flags; mistral's and qwen2's projections ignore them.
        if _flag("attention_bias", _field(config, "attention_bias")):
            attention += q_dim + 2 * kv_dim + d  # a bias on all four projections
        if _flag("mlp_bias", _field(config, "mlp_bias")):
            mlp += 2 * inter + d
    block = attention + mlp + 2 * d  # two RMSNorm weight vectors, no bias
    embedding = vocab * d
    blocks = shape.num_layers * block
    head = 0 if shape.tie_word_embeddings else vocab * d
    sizes = [d * q_dim, d * kv_dim, d * kv_dim, q_dim * d, d * inter, d * inter, inter * d, d, d]
    if model_type == "qwen2":
        sizes += [q_dim, kv_dim, kv_dim]
    elif model_type == "llama":
        if _flag("attention_bias", _field(config, "attention_bias")):
            sizes += [q_dim, kv_dim, kv_dim, d]
        if _flag("mlp_bias", _field(config, "mlp_bias")):
            sizes += [inter, inter, d]
    outside = [embedding, d] + ([head] if head else [])
    return Counts(
        total=embedding + blocks + d + head,
        embedding=embedding,
        blocks=blocks,
        tensors=_tally(sizes * shape.num_layers + outside),
        # q, k, v, o; gate, up, down
        linears=(
            *((d, q_dim), (d, kv_dim), (d, kv_dim), (q_dim, d)),
            *((d, inter), (d, inter), (inter, d)),
        ),
    )


def _tally(sizes: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(collections.Counter(sizes).items()))


def _gpt2_counts(shape: Shape) -> Counts:
    """Count a GPT-2 model: learned positions, fused qkv with bias, LayerNorm with bias."""
    d, inter, vocab = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    attention = (d * 3 * d + 3 * d) + (d * d + d)  # c_attn, c_proj (Conv1D with bias)
    mlp = (d * inter + inter) + (inter * d + d)  # c_fc, c_proj
    block = attention + mlp + 2 * 2 * d  # ln_1, ln_2: weight and bias
    embedding = vocab * d + shape.max_position_embeddings * d
    blocks = shape.num_layers * block
    head = 0 if shape.tie_word_embeddings else vocab * d
    sizes = [d * 3 * d, 3 * d, d * d, d, d * inter, inter, inter * d, d, d, d, d, d]
    outside = [vocab * d, shape.max_position_embeddings * d, d, d] + ([head] if head else [])
    return Counts(
        total=embedding + blocks + 2 * d + head,
        embedding=embedding,
        blocks=blocks,
        tensors=_tally(sizes * shape.num_layers + outside),
        linears=((d, 3 * d), (d, d), (d, inter), (inter, d)),  # c_attn, c_proj, c_fc, c_proj
    )


def transformers_config(config: Mapping[str, Any]) -> PretrainedConfig:
    """The transformers config class of ``config["model_type"]`` built from the fields.

    Imports transformers: only families outside :data:`ANALYTIC_FAMILIES` need it here.

    Raises:
        ValueError: If transformers does not know the ``model_type`` or rejects a field.
    """
    from transformers import AutoConfig

    fields = copy.deepcopy(dict(config))  # config classes may rewrite nested fields in place
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except ValueError:
        raise
    except Exception as exc:
        # transformers 5 validates fields with huggingface_hub's strict dataclasses, whose
        # errors derive from Exception alone: one line in the one error type callers catch.
        raise ValueError(" ".join(str(exc).split()) or type(exc).__name__) from exc


def _shape_of(cfg: PretrainedConfig) -> Shape:
    """Read a transformers config; ``attribute_map`` resolves each family's own field names."""
    hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    explicit = getattr(cfg, "head_dim", None)
    intermediate = getattr(cfg, "intermediate_size", None)
    if intermediate is None:
        intermediate = getattr(cfg, "n_inner", None) or 4 * hidden
    activation = getattr(cfg, "hidden_act", None) or getattr(cfg, "activation_function", "")
    return Shape(
        num_layers=int(cfg.num_hidden_layers),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(explicit) if explicit else hidden // heads,
        intermediate_size=int(intermediate),
        vocab_size=int(cfg.vocab_size),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        max_position_embeddings=int(cfg.max_position_embeddings),
        activation=str(activation),
    )


_META_COUNTS: dict[str, Counts] = {}


def _linears(block: Any) -> tuple[tuple[int, int], ...]:
    """(in, out) features of each linear layer of a built block: ``nn.Linear`` and GPT-2's
    ``Conv1D`` (whose weight is stored transposed), the layers peft's ``all-linear`` takes."""
    import torch

    found = []
    for module in block.modules():
        if isinstance(module, torch.nn.Linear):
            found.append((module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":
            rows, columns = module.weight.shape
            found.append((int(rows), int(columns)))
    return tuple(found)


def _meta_counts(cfg: PretrainedConfig) -> Counts:
    """Count any causal LM by building it on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

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
        first = stacks[0][0] if stacks and depth else None
        _META_COUNTS[key] = Counts(
            total=total,
            embedding=sum(tables.values()),
            blocks=blocks,
            tensors=_tally([p.numel() for p in model.parameters()]),
            linears=_linears(first) if first is not None else (),
        )
    return _META_COUNTS[key]

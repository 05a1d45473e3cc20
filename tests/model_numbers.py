"""Shape numbers and parameter counts of a model, read both ways: from a
:class:`~autotune.models.ModelSpec` (torch-free) and from what transformers builds."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from autotune.models import ModelSpec
from autotune.probe.modeling import hf_config


def _meta_model(spec: ModelSpec) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(spec))


def transformers_numbers(cfg: PretrainedConfig) -> dict[str, object]:
    """A spec's shape numbers, read off a transformers config the way the modeling code does."""
    heads = cfg.num_attention_heads
    inner = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
    return {
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "intermediate_size": inner or 4 * cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


def spec_numbers(spec: ModelSpec) -> dict[str, object]:
    """The same numbers as :func:`transformers_numbers`, from the spec's torch-free reader."""
    return {
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.max_position_embeddings,
    }


def meta_model(spec: ModelSpec) -> torch.nn.Module:
    """The real model of ``spec``, on the meta device."""
    return _meta_model(spec)


def meta_counts(spec: ModelSpec) -> tuple[int, int, int]:
    """Total, lookup-table and decoder-block parameters of the real model on meta."""
    model = _meta_model(spec)
    total = sum(p.numel() for p in model.parameters())
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tables = {id(m.weight): m.weight.numel() for m in embeddings}
    layers = model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else None
    if layers is None:
        layers = model.transformer.h  # gpt2
    blocks = sum(p.numel() for p in layers.parameters())
    return total, sum(tables.values()), blocks

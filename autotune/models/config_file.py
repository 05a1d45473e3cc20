"""Reading a Hugging Face ``config.json`` into a :class:`ModelSpec`.

The analytic families (llama, mistral, qwen2, gpt2) are read and checked without transformers.
Any other ``model_type`` needs transformers to know whether it is a causal LM at all, so it is
imported for those files only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.models.families import ANALYTIC_FAMILIES, read_shape
from autotune.models.spec import ModelSpec

__all__ = ["load_config"]


def load_config(path: Path) -> ModelSpec:
    """Read a ``config.json`` and check that it describes a causal LM.

    Args:
        path: The file, or the folder holding it.

    Returns:
        The spec holding the file's fields, named after the folder holding the file.

    Raises:
        ValueError: One line: the file cannot be read or parsed, lacks a ``model_type``, has a
            malformed shape field, or describes no causal LM.
    """
    file = path / "config.json" if path.is_dir() else path
    name = file.resolve().parent.name
    try:
        spec = ModelSpec(name=name, config=_read_fields(file))
        causal = _is_causal_lm(spec.model_type)
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"cannot load model config from '{path}': {_first_line(exc)}") from exc
    if not causal:
        raise ValueError(f"model config '{path}' is a {spec.model_type!r}, not a causal LM")
    not_decoder = _not_decoder_only(spec.config)
    if not_decoder:
        raise ValueError(
            f"model config '{path}' is {not_decoder}, not a decoder-only causal LM: autotune "
            "tunes causal LM training (llama, mistral, qwen2, gpt2 and the like)"
        )
    try:
        # Read the shape now, so that a malformed field fails here and not in the middle of a
        # plan (other families: transformers' config class checks the fields as it builds).
        read_shape(spec.config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"cannot load model config from '{path}': {_first_line(exc)}") from exc
    return spec


def _read_fields(path: Path) -> dict[str, Any]:
    fields = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, found {type(fields).__name__}")
    if not isinstance(fields.get("model_type"), str) or not fields["model_type"]:
        raise ValueError("no model_type field")
    return fields


def _is_causal_lm(model_type: str) -> bool:
    """Whether transformers builds a causal LM for ``model_type`` (imported for other families).

    Raises:
        ValueError: If transformers knows no such ``model_type``.
    """
    if model_type in ANALYTIC_FAMILIES:
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"transformers knows no model_type {model_type!r}")
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _not_decoder_only(fields: Mapping[str, Any]) -> str | None:
    """What the file says the checkpoint is when that is not a decoder-only causal LM (an
    encoder-decoder, or an encoder such as BERT saved as its masked-LM head, whose family
    transformers can also build as a causal LM), else None."""
    if fields.get("is_encoder_decoder"):
        return f"an encoder-decoder ({fields['model_type']!r})"
    architectures = fields.get("architectures")
    if isinstance(architectures, list) and architectures:
        names = [str(name) for name in architectures]
        if not any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in names):
            return f"a {', '.join(names)} ({fields['model_type']!r})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""MODEL ``hf:TYPE``: a Hugging Face causal language model built from its config, nothing downloaded.

``hf:llama --config num_hidden_layers=32,hidden_size=4096`` is
``AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_hidden_layers=32, hidden_size=4096))``
with random weights (none on ``meta``); its example input is ``--batch`` sequences of ``--seq-len`` token ids.
``--config`` keys must be the config's own (``n_layer`` and its alias ``num_hidden_layers`` both work for
GPT-2): ``for_model`` would keep a misspelt key as a new attribute the model never reads, so a key the config
does not have is refused, naming the nearest ones. A key the model's own code reads with a default where the
config leaves it unset (``getattr(config, "head_dim", hidden_size // heads)``: Qwen3-MoE's, Llama's) is a setting
too, though the default config has no such attribute.
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any

import torch
from torch import nn

__all__ = ["build_hf", "parse_config", "token_inputs"]


def parse_config(text: str | None) -> dict[str, Any]:
    """``"num_hidden_layers=32,hidden_size=4096,tie_word_embeddings=false"`` -> a dict of ints, floats, booleans,
    ``None`` (``none``/``null``) or strings."""
    out: dict[str, Any] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"--config {text!r}: {part.strip()!r} is not KEY=VALUE; write e.g. "
                             "--config num_hidden_layers=32,hidden_size=4096")
        out[key] = _value(value)
    return out


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _close(name: str, known: list[str]) -> str:
    near = difflib.get_close_matches(name, known, n=3)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def build_hf(kind: str, overrides: dict[str, Any], dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` of ``AutoConfig.for_model(kind, **overrides)`` on the current default device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as exc:
        raise ValueError(f"hf:{kind}: transformers is not installed (pip install transformers)") from exc
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"hf:{kind}: transformers has no model type {kind!r}{_close(kind, list(CONFIG_MAPPING))}; "
                         "use a config's model_type, e.g. hf:llama, hf:gpt2, hf:qwen2")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"hf:{kind}: {kind!r} has no causal language model in transformers (AutoModelForCausalLM)"
                         f"{_close(kind, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))}; hf:TYPE builds those only")
    default = AutoConfig.for_model(kind)
    read = _read_with_default(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
    known = sorted(set(default.to_dict()) | set(getattr(default, "attribute_map", {})) | read)
    unknown = [k for k in overrides if not hasattr(default, k) and k not in read]
    if unknown:
        key = unknown[0]
        raise ValueError(f"--config {key}: the {type(default).__name__} of hf:{kind} has no setting {key!r}"
                         f"{_close(key, known)}; its settings are {', '.join(k for k in known if not k.startswith('_'))[:300]} ...")
    config = AutoConfig.for_model(kind, **overrides)
    try:
        return AutoModelForCausalLM.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    except (ValueError, TypeError, AssertionError) as exc:
        raise ValueError(f"hf:{kind} cannot be built with --config {overrides}: {str(exc).splitlines()[0]}") from exc


def _read_with_default(class_name: str) -> set[str]:
    """The config keys the modeling module of ``class_name`` reads as ``getattr(config, "KEY", ...)``: settings the
    model takes though its default config has no such attribute (``head_dim``)."""
    import transformers
    try:
        source = inspect.getsource(inspect.getmodule(getattr(transformers, class_name)))
    except (AttributeError, OSError, TypeError):
        return set()
    return set(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']", source))


def token_inputs(model: nn.Module, batch: int, seq_len: int, device: str | torch.device) -> tuple[torch.Tensor]:
    """``batch`` sequences of ``seq_len`` token ids (random below the vocabulary, zeros on ``meta``)."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {limit} positions: pass a shorter "
                         f"--seq-len or --config max_position_embeddings={seq_len} (n_positions for GPT-2)")
    if str(device) == "meta":
        return (torch.zeros(batch, seq_len, dtype=torch.long, device=device),)
    return (torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device),)

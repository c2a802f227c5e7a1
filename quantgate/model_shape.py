"""The KV-cache shape of a decoder, read from its config: one parser for the engine and the capacity math."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class KVShape(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int


class _Attributes:
    """A config object read like the dict of its config.json."""

    def __init__(self, obj: Any):
        self.obj = obj

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self.obj, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self.obj, key, default)


def text_config(config: Mapping | Any) -> Mapping | _Attributes:
    """The language model's part of a config (a multimodal one nests it), as a mapping."""
    if isinstance(config, Mapping):
        return config.get("text_config", config)
    return _Attributes(config.get_text_config() if hasattr(config, "get_text_config") else config)


def kv_shape(config: Mapping | Any) -> KVShape:
    """Layers, KV heads (GQA: fewer than the attention heads) and head size; KeyError names a missing key."""
    config = text_config(config)
    heads = config["num_attention_heads"]
    return KVShape(config["num_hidden_layers"], config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads)


def attention_window(config) -> int | None:
    """The sliding window some layers attend within (Gemma 3, Mistral, Qwen2 with `use_sliding_window`), or
    None when every layer sees the whole context. Paged attention takes each layer's own window from what
    the model's forward passes it (serving/model/attention.py); this only says whether a model has one."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None

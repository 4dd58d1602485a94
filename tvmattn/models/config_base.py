"""What every model configuration shares (below config.py and each architecture's own config):
the configuration error, its message, HF's per-layer attention kinds and how an HF config.json
lays out its sliding-window layers."""

from __future__ import annotations

from typing import Any

# Per-layer attention kinds of ModelConfig.layer_types (HF's names).
LAYER_TYPES = ("full_attention", "sliding_attention")


class ModelConfigError(ValueError):
    """A model configuration the decoder cannot run; the message names the field."""


def _fail(field: str, value, expected: str):
    raise ModelConfigError(f"model config: {field}={value!r} is not supported: expected {expected}")


def _sliding_layers(config: dict[str, Any], model_type: str) -> tuple[int, tuple[str, ...]]:
    """(sliding_window, layer_types) of an HF config: no window (or use_sliding_window false,
    Qwen2's default) gives (0, ()); otherwise `layer_types` as given, or from
    `sliding_window_pattern` N (layer i is full when (i + 1) % N == 0, else sliding: Gemma-3's
    rule; N = 2 is Gemma-2's alternation), or from Qwen2's `max_window_layers` M (layers >= M
    slide), or every layer sliding (Mistral)."""
    window = config.get("sliding_window") or 0
    if not window or not config.get("use_sliding_window", model_type != "qwen2"):
        return 0, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        _fail("sliding_window", window, "a positive integer")
    layers = config["num_hidden_layers"]
    if config.get("layer_types") is not None:
        return window, tuple(config["layer_types"])
    pattern = config.get("sliding_window_pattern")
    if pattern is not None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            _fail("sliding_window_pattern", pattern, "a positive integer")
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type == "qwen2" and config.get("max_window_layers") is not None:
        sliding = [i >= config["max_window_layers"] for i in range(layers)]
    else:
        sliding = [True] * layers
    return window, tuple(LAYER_TYPES[s] for s in sliding)

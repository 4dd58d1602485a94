"""Gemma 3 (text): its configuration (`config`), the decoder and its parameter map (`model`), its
GGUF tensor names and metadata (`gguf`) and its chat template (`template`), one architecture
per folder as MLC-LLM's `model/<arch>/`."""

from .config import MODEL_TYPES as MODEL_TYPES
from .config import Gemma3Config as Gemma3Config

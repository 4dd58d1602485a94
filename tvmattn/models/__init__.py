"""Models on the tvmattn cache: the Llama-family decoder (`llama`, optionally with sliding-window
layers), the DeepSeek-V2 MLA decoder (`deepseek`, on the MLA cache of `mla_cache`), their
configurations (`config`), the nn-level KV cache that emits `tvmattn.*` calls (`kv_cache`), the
choice of decoder per config (`architectures`) and the library export (`export`).

Built on `tvmattn.quant` (layers whose weights stay in GGUF blocks), `tvmattn.compiler` (the
Relax pipeline the export runs), `tvmattn.weights` and `tvmattn.runtime.ffi`; `tvmattn.build` and
`tvmattn.generate` sit above."""

from .config import DeepseekV2Config as DeepseekV2Config
from .config import ModelConfig as ModelConfig
from .config import ModelConfigError as ModelConfigError
from .config import model_config_from_hf as model_config_from_hf
from .export import BuildOptions as BuildOptions
from .export import ModelLibrary as ModelLibrary
from .export import compile_library as compile_library
from .export import compile_module as compile_module
from .export import export_library as export_library
from .export import export_module as export_module
from .export import pack_params as pack_params
from .export import read_metadata as read_metadata
from .kv_cache import KVCacheSpec as KVCacheSpec
from .kv_cache import TvmattnKVCache as TvmattnKVCache
from .llama import LlamaForCausalLM as LlamaForCausalLM
from .llama import hf_parameter_sources as hf_parameter_sources

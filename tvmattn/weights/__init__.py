"""Weight readers: GGUF files and Hugging Face safetensors folders -> float32 numpy tensors.

Layer 3 of docs/style.md (model and build): imports nothing from the cache or the kernels.
Every reader returns a `LoadedModel` (a Hugging Face style `config.json` dict plus float32
tensors under Hugging Face parameter names, in Hugging Face shapes) or raises `WeightError`
naming the file, the tensor and the problem; nothing is written anywhere.
"""

from .common import LoadedModel as LoadedModel
from .common import WeightError as WeightError
from .common import expected_shapes as expected_shapes
from .gguf_file import chat_template as chat_template
from .gguf_file import read_gguf as read_gguf
from .gguf_file import tokenizer_from_gguf as tokenizer_from_gguf
from .locate import GEMMA3_INSTALL as GEMMA3_INSTALL
from .locate import SMOLLM2_INSTALL as SMOLLM2_INSTALL
from .locate import gemma3_path as gemma3_path
from .locate import smollm2_path as smollm2_path
from .quant import QUANT_TYPES as QUANT_TYPES
from .quant import QuantizedTensor as QuantizedTensor
from .quant import dequantize as dequantize
from .quant import split_blocks as split_blocks
from .safetensors_folder import read_safetensors_folder as read_safetensors_folder

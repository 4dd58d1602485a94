"""tvmattn: TVM-native paged attention for LLM inference.

The kernels live in the sibling package `tir_kernels` (generators from a validated
`AttentionConfig` to TIR PrimFuncs, for CUDA and the CPU). This package holds what is
built on top of them: for now the `python -m tvmattn demo` smoke run (`tvmattn.demo`).
A Python paged KV cache is planned and not part of this version.
"""

__version__ = "0.1.0"

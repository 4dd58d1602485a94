"""Block-quantized weights in a model: fused dequantize + matmul kernels over GGUF blocks and the
nn layers that call them.

In layers, each module importing only those above it in this list:
- `config`: what a kernel computes (`QuantMatmulConfig`) and the names shared by every variant;
- `algorithms`: the TE algorithms (the dequantization, the product, the embedding lookup);
- `signature`: `prim_func`, a kernel's PrimFunc signature of any argument count around its T.macro body;
- `cpu`: the llvm schedules and the AVX-512 lookup GEMV; `gemv_cuda`: the CUDA GEMV of our own;
- `matmul`: the dispatch (`kernel`: the scheduled PrimFunc of a config on its target);
- `linear`: `QuantLinear` and `QuantEmbedding`, the nn modules a model builds from.

The block formats themselves (layouts, packing) are `tvmattn.weights.quant`'s. Below
`tvmattn.models`; above `tvmattn.compiler.targets` and `tir_kernels`.
"""

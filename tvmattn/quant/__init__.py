"""Block-quantized weights in a model: fused dequantize + matmul kernels over GGUF blocks and the
nn layers that call them."""

"""Compiling a model library: the Relax pipeline (`pipeline.relax_pipeline`: the stock backend
passes plus our schedule rules), its CPU schedule rules for the model's own functions
(`cpu_matmul`: multi-token projections; `cpu_elementwise`: elementwise functions and the float32
SiLU; `cpu_norm`: a prompt's RMSNorms), the fused decode ops of a decoder layer (`fused_decode`: RMSNorm + projection + epilogue,
what they compute; `fused_schedules`: their CUDA and CPU schedules), a tensor-core kernel for
decode_step's projections (`tensor_core_matmul`, from batch 16 on), programmatic dependent
launch for every CUDA kernel of a library (`dependent_launch`, opt-in), the count of a lowered
step's kernel launches (`kernel_count`) and the targets the kernels compile for (`targets`: the
host CPU's llvm target, the CUDA target whose limits the schedules read).

Below `tvmattn.quant` (whose kernels compile for `targets`) and `tvmattn.models` (whose export
runs the pipeline); imports nothing of either.
"""

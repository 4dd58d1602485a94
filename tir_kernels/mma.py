"""The pieces of the mma.sync tensor-core kernels (sm_80 and newer) that more than one uses.

prefill_sm80 (prefill), decode_tc (decode) and mla_tc (MLA decode) compute with
`mma.sync.aligned.m16n8k16` and fp32 accumulation on 16-bit operands, load fragments with
`ldmatrix` from shared-memory tiles filled by 16-byte `cp.async` copies, and lay those tiles
out the same way (`Tile`). The instruction names and the layout live here, below all three.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .support import MMA_MIN_SM, PTX_DTYPE_NAMES, TENSOR_CORE_DTYPES

MMA_DTYPES = {dtype: PTX_DTYPE_NAMES[dtype] for dtype in TENSOR_CORE_DTYPES}  # dtype -> PTX type
MIN_ARCH = MMA_MIN_SM  # cp.async, bf16 mma and ldmatrix.trans for 16-bit types: sm_80 and newer
ROWS_PER_MMA = 16  # the M of m16n8k16
CHUNK = 8  # 16-bit elements per 16-byte chunk (cp.async size, one ldmatrix row)
SWIZZLE = 8  # chunks per XOR-swizzle period: 8 chunks = 128 bytes = the 32 banks
FULL_WARP = 0xFFFFFFFF
LDSM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
LDSM_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
CP_ASYNC = "cp.async.cg.shared.global"


def mma_name(dtype: str) -> str:
    """The m16n8k16 MMA instruction on `dtype` operands with fp32 accumulators."""
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{MMA_DTYPES[dtype]}.{MMA_DTYPES[dtype]}.f32"


def pack_name(dtype: str) -> str:
    """The conversion of two fp32 values to one register of two `dtype` values."""
    return f"cvt.rn.{MMA_DTYPES[dtype]}x2.f32"


class Tile:
    """Shared-memory layout of a tile of rows of `width` 16-bit elements, in 16-byte chunks.

    Rows of a multiple of 8 chunks are XOR-swizzled (chunk c of row r is stored at chunk
    c ^ (r % 8)), so the 8 rows an ldmatrix phase reads, and the chunks a cp.async wave
    writes, fall in distinct banks. Other widths get one chunk of padding per row (an odd
    number of chunks per row), which does the same.
    """

    def __init__(self, width: int):
        self.chunks = width // CHUNK
        self.swizzled = self.chunks % SWIZZLE == 0
        self.stride = width if self.swizzled else width + CHUNK

    def offset(self, row, chunk):
        """Element offset of chunk `chunk` of row `row`."""
        if self.swizzled:
            return row * self.stride + T.bitwise_xor(chunk, row % SWIZZLE) * CHUNK
        return row * self.stride + chunk * CHUNK

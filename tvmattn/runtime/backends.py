"""Attention backends: how the cache calls an attention kernel, mirroring TVM's attn_backend.h.

One class per kernel role (paged prefill, ragged prefill, paged decode, tree-mask paged and
ragged prefill), each with `mha(...)`, `mla(...)` and a `begin_forward(...)` plan step, in two
flavours:
- TIR (`["tir", f]` or `["tirx", f]`, or a bare function): `f` is a compiled kernel with the
  contract's arguments (docs/interface.md); `mha`/`mla` call it in that order and
  `begin_forward` does nothing.
- FlashInfer (`["flashinfer", run, plan(, qk_head_dim, v_head_dim)]`): FlashInfer's run and plan
  functions (tvmattn.flashinfer builds and loads them); `begin_forward` plans once per forward
  and cascade depth into a workspace the cache binds (`bind_workspace`), `mha` runs in
  attn_backend.h's order (MHA only).

The method arguments follow attn_backend.h (without the CUDA stream): note that `mha` of the
paged and ragged prefill takes `q_rope_position` before `k_rope_pos_offset`, while the kernels
take them the other way round.

`backend_from_spec(spec, role)` converts a spec for one role; `[]` or None means the role is
not provided (returns None).
"""

from __future__ import annotations

import enum

from .errors import KVCacheError


class RopeMode(enum.IntEnum):
    """Where RoPE is applied (TVM's RoPEMode): NONE never; NORMAL by split_rotary before the
    K/V are cached; INLINE inside the attention kernels (rotary_mode = 1), K cached unrotated."""

    NONE = 0
    NORMAL = 1
    INLINE = 2

    @classmethod
    def parse(cls, value) -> "RopeMode":
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in cls._value2member_map_:
            return cls(value)
        raise KVCacheError(f'rope_mode must be "none", "normal" or "inline" (or 0, 1, 2), got {value!r}')


class AttnBackend:
    """A kernel of one role; `kind` is "tir" or "flashinfer"."""

    kind = "tir"

    def __init__(self, func):
        self.func = func

    def new_forward(self) -> None:
        """A forward step begins (its plans come next); nothing to do for TIR kernels."""

    def _unsupported(self, what: str):
        raise KVCacheError(f"{type(self).__name__}: {what} is not supported by this backend")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.func!r})"


class PagedPrefill(AttnBackend):
    """Prefill attention of packed queries over paged K/V."""

    def mha(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, q_rope_position,
            k_rope_pos_offset, causal, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, causal, sm_scale,
            attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, depth, qo_indptr, page_indptr, last_page_len, batch_size, total_qo_len, page_size,
                      num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, causal):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRPagedPrefill(PagedPrefill):
    def mha(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, q_rope_position,
            k_rope_pos_offset, causal, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(causal), int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta,
                  sm_scale)

    def mla(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, causal, sm_scale,
            attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, attn_output, attn_lse, int(causal),
                  sm_scale)


class RaggedPrefill(AttnBackend):
    """Prefill attention of packed queries over packed (ragged) K/V."""

    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rope_mode,
            rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def begin_forward(self, qo_indptr, kv_indptr, batch_size, total_qo_len, num_qo_heads, num_kv_heads,
                      qk_head_dim, v_head_dim, causal):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRRaggedPrefill(RaggedPrefill):
    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rope_mode,
            rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, attn_output, attn_lse,
                  int(causal), int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)


class PagedDecode(AttnBackend):
    """Decode attention (one query token per request) over paged K/V."""

    def mha(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, depth, q, pages, page_indptr, page_indices, length_info, sm_scale, attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, depth, page_indptr, batch_size, page_size, num_qo_heads, num_kv_heads, qk_head_dim,
                      v_head_dim, rope_mode, q_dtype, kv_dtype):
        """Plan step (host arrays are numpy int32); nothing to do for TIR kernels."""


class TIRPagedDecode(PagedDecode):
    def mha(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)

    def mla(self, depth, q, pages, page_indptr, page_indices, length_info, sm_scale, attn_output, attn_lse):
        self.func(q, pages, page_indptr, page_indices, length_info, attn_output, attn_lse, sm_scale)


class PagedPrefillTreeMask(AttnBackend):
    """Token-tree attention over paged K/V (a node sees the history and its ancestors)."""

    def mha(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
            q_rope_position, tree_attn_mn_indptr, tree_attn_mask, rope_mode, rotary_scale, rotary_theta,
            sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, tree_attn_mn_indptr,
            tree_attn_mask, sm_scale, attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, page_indptr, last_page_len, qo_indptr, batch_size, page_size, num_qo_heads,
                      num_kv_heads, qk_head_dim, v_head_dim, rope_mode):
        """Plan step; nothing to do for TIR kernels."""


class TIRPagedPrefillTreeMask(PagedPrefillTreeMask):
    def mha(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
            q_rope_position, tree_attn_mn_indptr, tree_attn_mask, rope_mode, rotary_scale, rotary_theta,
            sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale,
                  tree_attn_mn_indptr, tree_attn_mask)


class RaggedPrefillTreeMask(AttnBackend):
    """Token-tree attention over packed K/V (the nodes of this forward)."""

    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self._unsupported("MHA")

    def mla(self, q, compressed_kv, k_pe, qo_indptr, kv_indptr, tree_attn_mn_indptr, tree_attn_mask, sm_scale,
            attn_output, attn_lse):
        self._unsupported("MLA")

    def begin_forward(self, page_indptr, last_page_len, qo_indptr, batch_size, page_size, num_qo_heads,
                      num_kv_heads, qk_head_dim, v_head_dim, rope_mode):
        """Plan step; nothing to do for TIR kernels."""


class TIRRaggedPrefillTreeMask(RaggedPrefillTreeMask):
    def mha(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
            rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        self.func(q, qo_indptr, k, v, kv_indptr, q_rope_position, tree_attn_mn_indptr, tree_attn_mask,
                  attn_output, attn_lse, int(rope_mode == RopeMode.INLINE), rotary_scale, rotary_theta, sm_scale)


class FlashInferWorkspace:
    """The buffers FlashInfer's plan and run functions share, allocated once per cache (as in
    TVM's cache): one float workspace (`float_bytes`, 768 MiB as TVM's) and, per plan slot (0:
    ragged prefill, d + 1: paged level d), an int workspace on the device and its page-locked
    host copy (`int_bytes`, 8 MiB each; slots are allocated on first use)."""

    FLOAT_BYTES = 768 << 20
    INT_BYTES = 8 << 20

    def __init__(self, device, float_bytes: int = FLOAT_BYTES, int_bytes: int = INT_BYTES):
        import tvm

        self.device = device
        self.int_bytes = int(int_bytes)
        self.float = tvm.runtime.empty((int(float_bytes),), "uint8", device=device)
        self._host = _host_device(device)
        self._slots: list[tuple] = []

    def slot(self, index: int) -> tuple:
        """(float workspace, int workspace, page-locked int workspace) of plan slot `index`."""
        import tvm

        while len(self._slots) <= index:
            self._slots.append((tvm.runtime.empty((self.int_bytes,), "uint8", device=self.device),
                                tvm.runtime.empty((self.int_bytes,), "uint8", device=self._host)))
        return (self.float, *self._slots[index])


def _host_device(device):
    """Page-locked host memory for a CUDA device (TVM's cuda_host), else the CPU."""
    import tvm

    if device.dlpack_device_type() == 2:  # kDLCUDA
        try:
            host = tvm.runtime.device(3, 0)  # kDLCUDAHost
            tvm.runtime.empty((1,), "uint8", device=host)
            return host
        except Exception:  # noqa: BLE001 - a TVM without cuda_host allocation: pageable memory works too
            pass
    return tvm.cpu()


def _host_int32(array):
    """A host (CPU) int32 tensor of a numpy array, for the plan functions."""
    import numpy as np
    import tvm

    return tvm.runtime.tensor(np.ascontiguousarray(array, dtype=np.int32))


class _FlashInfer:
    """Mixin of the FlashInfer flavour: `run` and `plan` are FlashInfer's functions (tvm-ffi
    functions of a module built by tvmattn.flashinfer, or any callables with their arguments).

    `begin_forward` calls `plan` with attn_backend.h's arguments and keeps the plan of that
    depth; `mha` calls `run` with the workspaces and plan of its depth, K and V as strided views
    of the page pool, index arrays re-based to byte offset 0, and the reciprocal RoPE scale and
    theta. The cache binds its workspace (`bind`) before the first plan; a backend object serves
    one cache.
    """

    kind = "flashinfer"

    def __init__(self, run, plan, qk_head_dim: int = -1, v_head_dim: int = -1):
        if not callable(run) or not callable(plan):
            raise KVCacheError(f"{type(self).__name__}: run and plan must be functions, got {run!r}, {plan!r}")
        self.func = self.run = run
        self.plan = plan
        self.qk_head_dim_override = int(qk_head_dim)
        self.v_head_dim_override = int(v_head_dim)
        self.workspace: FlashInferWorkspace | None = None
        self._plans: dict = {}  # depth -> (float workspace, int workspace, plan_info)
        self._kv: dict = {}  # (data pointer, shape) of a page pool -> its (K, V) views
        # this forward's re-based views: by (data pointer, shape, dtype), and by id(tensor) -> (tensor, view)
        self._rebased: dict = {}

    def bind(self, workspace: FlashInferWorkspace) -> None:
        self.workspace = workspace

    def new_forward(self) -> None:
        """Forget the last forward's plans: a run without this forward's plan is an error, never
        a stale plan."""
        self._plans.clear()
        self._rebased.clear()

    def _slot(self, index: int) -> tuple:
        if self.workspace is None:
            raise KVCacheError(f"{type(self).__name__}: no workspace bound; a cache binds its own (bind)")
        return self.workspace.slot(index)

    def _keep(self, depth, buffers: tuple, plan_info) -> None:
        self._plans[depth] = (buffers[0], buffers[1], plan_info)
        self._rebased.clear()  # a new forward's index arrays

    def _views(self, pages) -> tuple:
        """K and V views of a page pool (kept: a cache's pools live as long as its backends)."""
        from tvmattn.flashinfer.views import paged_kv_views

        return _memo(self._kv, pages, lambda: (pages.data_ptr(), tuple(pages.shape)), paged_kv_views)

    def _base(self, array):
        """`array` re-based to byte offset 0 (kept until the next plan): FlashInfer ignores DLPack's
        byte_offset, and a model library's VM may hand views of its storage with one."""
        if not hasattr(array, "data_ptr"):
            return array
        from tvmattn.flashinfer.views import rebased

        return _memo(self._rebased, array, lambda: (array.data_ptr(), tuple(array.shape), str(array.dtype)), rebased)

    def mha(self, *args):
        self.run(*self.run_args(*args))

    def _planned(self, depth):
        try:
            return self._plans[depth]
        except KeyError:
            raise KVCacheError(f"{type(self).__name__}: no plan for depth {depth}; begin_forward plans it") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run={self.run!r}, plan={self.plan!r})"


def _memo(memo: dict, tensor, key_of, make):
    """make(tensor), remembered in `memo`: found by the tensor's identity first (the plan's index
    views and the pools are the same objects at every layer), else by key_of() (a new object over
    the same memory, e.g. the VM's q, o, lse each layer)."""
    hit = memo.get(id(tensor))
    if hit is not None and hit[0] is tensor:  # the entry holds the tensor, so its id is not reused
        return hit[1]
    key = key_of()
    value = memo.get(key)
    if value is None:
        value = memo[key] = make(tensor)
    memo[id(tensor)] = (tensor, value)
    return value


def _kv_lengths(page_indptr, last_page_len, page_size: int):
    """Tokens per request of a paged level: (pages - 1) * page_size + last page's (0 without pages)."""
    import numpy as np

    pages = np.diff(np.asarray(page_indptr, dtype=np.int64))
    last = np.asarray(last_page_len, dtype=np.int64).reshape(-1)[: len(pages)]
    return np.where(pages > 0, (pages - 1) * page_size + last, 0)


def _rcp(value: float) -> float:
    return 1.0 / float(value)


# The prefill plan of FlashInfer 0.7 takes one argument more than attn_backend.h passes (TVM 0.27
# targets FlashInfer 0.6.3): uniform_q_len, 0 = no promise that every request has the same
# number of queries. The other arguments are attn_backend.h's, in its order.


class FlashInferPagedPrefill(_FlashInfer, PagedPrefill):
    def begin_forward(self, depth, qo_indptr, page_indptr, last_page_len, batch_size, total_qo_len, page_size,
                      num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, causal):
        buffers = self._slot(depth + 1)
        kv_len = _kv_lengths(page_indptr, last_page_len, page_size)
        info = self.plan(*buffers, _host_int32(qo_indptr), _host_int32(page_indptr), _host_int32(kv_len),
                         int(total_qo_len), int(batch_size), int(num_qo_heads), int(num_kv_heads), int(page_size),
                         False, int(qk_head_dim), int(v_head_dim), bool(causal), -1, -1, False, 0, 0)
        self._keep(depth, buffers, info)

    def run_args(self, depth, q, qo_indptr, pages, page_indptr, page_indices, length_info, q_rope_position,
                 k_rope_pos_offset, causal, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        """The arguments of `run` for mha(...) (same arguments): attn_backend.h's order."""
        float_ws, int_ws, info = self._planned(depth)
        k, v = self._views(pages)
        b = self._base
        return (float_ws, int_ws, info, b(q), k, v, b(qo_indptr), b(page_indptr), b(page_indices), b(length_info),
                b(attn_output), b(attn_lse), int(causal), 1, -1, False,
                float(sm_scale), _rcp(rotary_scale), _rcp(rotary_theta))


class FlashInferRaggedPrefill(_FlashInfer, RaggedPrefill):
    def begin_forward(self, qo_indptr, kv_indptr, batch_size, total_qo_len, num_qo_heads, num_kv_heads,
                      qk_head_dim, v_head_dim, causal):
        import numpy as np

        if self.qk_head_dim_override >= 0:
            qk_head_dim = self.qk_head_dim_override
        if self.v_head_dim_override >= 0:
            v_head_dim, num_kv_heads = self.v_head_dim_override, num_qo_heads
        buffers = self._slot(0)
        kv_len = np.diff(np.asarray(kv_indptr, dtype=np.int64))
        info = self.plan(*buffers, _host_int32(qo_indptr), _host_int32(kv_indptr), _host_int32(kv_len),
                         int(total_qo_len), int(batch_size), int(num_qo_heads), int(num_kv_heads), 1, False,
                         int(qk_head_dim), int(v_head_dim), bool(causal), -1, -1, False, 0, 0)
        self._keep(0, buffers, info)

    def run_args(self, q, k, v, qo_indptr, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rope_mode,
                 rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        """The arguments of `run` for mha(...) (same arguments): attn_backend.h's order."""
        float_ws, int_ws, info = self._planned(0)
        b = self._base
        return (float_ws, int_ws, info, b(q), b(k), b(v), b(qo_indptr), b(kv_indptr), b(attn_output), b(attn_lse),
                int(causal), 0, -1, False, float(sm_scale), _rcp(rotary_scale), _rcp(rotary_theta))


class FlashInferPagedDecode(_FlashInfer, PagedDecode):
    def begin_forward(self, depth, page_indptr, batch_size, page_size, num_qo_heads, num_kv_heads, qk_head_dim,
                      v_head_dim, rope_mode, q_dtype, kv_dtype):
        import tvm

        buffers = self._slot(depth + 1)
        device = buffers[0].device
        empty_q = tvm.runtime.empty((0,), str(q_dtype), device=device)
        empty_kv = empty_q if str(kv_dtype) == str(q_dtype) else tvm.runtime.empty((0,), str(kv_dtype), device=device)
        info = self.plan(*buffers, _host_int32(page_indptr), int(batch_size), int(num_qo_heads), int(num_kv_heads),
                         int(page_size), False, -1, 0.0, int(qk_head_dim), int(v_head_dim), empty_q, empty_kv)
        self._keep(depth, buffers, info)

    def run_args(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                 q_rope_position, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        """The arguments of `run` for mha(...) (same arguments): attn_backend.h's order."""
        float_ws, int_ws, info = self._planned(depth)
        k, v = self._views(pages)
        b = self._base
        return (float_ws, int_ws, info, b(q), k, v, b(page_indptr), b(page_indices), b(length_info),
                b(attn_output), b(attn_lse), 1, -1, False, float(sm_scale), _rcp(rotary_scale), _rcp(rotary_theta))


class FlashInferTensorCoreDecode(_FlashInfer, PagedDecode):
    """Paged decode on tensor cores: FlashInfer's paged prefill (`run` = its paged run, `plan` its
    plan) with one query per request, as TVM's cache does for GQA groups of 4 or more.

    The decode plan step gets no last-page lengths, so the plan's key lengths are the pages'
    capacity (at most page_size - 1 too many per request: the split of the keys into chunks may
    be a little coarser; the run reads the true lengths from length_info)."""

    def __init__(self, run, plan, qk_head_dim: int = -1, v_head_dim: int = -1):
        super().__init__(run, plan, qk_head_dim, v_head_dim)
        self._qo_indptr: dict = {}  # (batch size, device) -> int32 [B+1] 0..B on the device

    def begin_forward(self, depth, page_indptr, batch_size, page_size, num_qo_heads, num_kv_heads, qk_head_dim,
                      v_head_dim, rope_mode, q_dtype, kv_dtype):
        import numpy as np

        buffers = self._slot(depth + 1)
        kv_len = np.diff(np.asarray(page_indptr, dtype=np.int64)) * int(page_size)
        info = self.plan(*buffers, _host_int32(np.arange(batch_size + 1)), _host_int32(page_indptr),
                         _host_int32(kv_len), int(batch_size), int(batch_size), int(num_qo_heads), int(num_kv_heads),
                         int(page_size), False, int(qk_head_dim), int(v_head_dim), False, -1, -1, False, 0, 0)
        self._keep(depth, buffers, info)

    def _arange(self, batch: int, device):
        import numpy as np
        import tvm

        key = (batch, device.dlpack_device_type(), device.index)
        if key not in self._qo_indptr:
            self._qo_indptr[key] = tvm.runtime.tensor(np.arange(batch + 1, dtype=np.int32), device=device)
        return self._qo_indptr[key]

    def run_args(self, depth, q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset,
                 q_rope_position, rope_mode, rotary_scale, rotary_theta, sm_scale, attn_output, attn_lse):
        """The arguments of the prefill `run` for mha(...) (same arguments)."""
        float_ws, int_ws, info = self._planned(depth)
        k, v = self._views(pages)
        qo_indptr = self._arange(int(page_indptr.shape[0]) - 1, pages.device)
        b = self._base
        return (float_ws, int_ws, info, b(q), k, v, qo_indptr, b(page_indptr), b(page_indices), b(length_info),
                b(attn_output), b(attn_lse), 0, 1, -1, False, float(sm_scale), _rcp(rotary_scale), _rcp(rotary_theta))


def bind_workspace(backends, device) -> FlashInferWorkspace | None:
    """One workspace for the FlashInfer backends among `backends` (None when there are none)."""
    flashinfer = [b for b in backends if b is not None and b.kind == "flashinfer"]
    if not flashinfer:
        return None
    workspace = FlashInferWorkspace(device)
    for backend in flashinfer:
        backend.bind(workspace)
    return workspace


# role -> (TIR flavour, FlashInfer flavour or None). TVM has no FlashInfer tree-mask kernels.
FLAVOURS = {
    PagedPrefill: (TIRPagedPrefill, FlashInferPagedPrefill),
    RaggedPrefill: (TIRRaggedPrefill, FlashInferRaggedPrefill),
    PagedDecode: (TIRPagedDecode, FlashInferPagedDecode),
    PagedPrefillTreeMask: (TIRPagedPrefillTreeMask, None),
    RaggedPrefillTreeMask: (TIRRaggedPrefillTreeMask, None),
}


def _resolve_names(functions) -> list:
    """run and plan of a FlashInfer spec: functions, or names of built modules' functions (a model
    library's spec, see tvmattn.flashinfer.modules.function_name) loaded here."""
    out = []
    for function in functions:
        if isinstance(function, str):
            from tvmattn.flashinfer.modules import FlashInferModulesMissing, resolve

            try:
                function = resolve(function)
            except (FlashInferModulesMissing, ValueError) as error:
                raise KVCacheError(str(error)) from None
        out.append(function)
    return out


def backend_from_spec(spec, role: type) -> AttnBackend | None:
    """A backend of `role` (one of the FLAVOURS keys) from a spec.

    spec: None or [] (not provided: returns None); a function (TIR); ["tir" | "tirx", f];
    ["flashinfer", run, plan(, qk_head_dim, v_head_dim)] (run and plan functions, or names from
    tvmattn.flashinfer.modules.function_name); or a backend of that role already.
    """
    if role not in FLAVOURS:
        raise KVCacheError(f"role must be one of {[r.__name__ for r in FLAVOURS]}, got {role!r}")
    tir, flashinfer = FLAVOURS[role]
    if spec is None:
        return None
    if isinstance(spec, role):
        return spec
    if isinstance(spec, AttnBackend):
        raise KVCacheError(f"a {role.__name__} backend is needed here, got {type(spec).__name__}")
    if callable(spec):
        return tir(spec)
    try:
        items = list(spec)
    except TypeError:
        raise KVCacheError(f"a {role.__name__} spec must be [], a function or a list, got {spec!r}") from None
    if not items:
        return None
    tag = str(items[0])
    if tag in ("tir", "tirx") and len(items) == 2 and callable(items[1]):
        return tir(items[1])
    if tag == "flashinfer" and flashinfer is not None and len(items) in (3, 5):
        return flashinfer(*_resolve_names(items[1:3]), *items[3:])
    raise KVCacheError(
        f'a {role.__name__} spec must be [], ["tir" | "tirx", f] or ["flashinfer", run, plan(, qk_head_dim, '
        f"v_head_dim)], got {spec!r}"
    )

"""Page-pool kernels (transpose_append, copy_single_page, compact_copy, debug_get_kv) against
numpy, CPU and CUDA. Copies are exact, so results are compared bit for bit over the whole pool."""

import zlib

import numpy as np
import pytest
import tvm
from harness import device_for, empty, index_view, randn, tensor

from tir_kernels import AttentionConfig, compact_copy, copy_single_page, debug_get_kv, transpose_append

# (num_kv_heads, head_dim, page_size, dtype): every dtype, page sizes 1/16/64/128, head dims 16..256.
CASES = [
    (2, 128, 16, "float16"),
    (4, 64, 1, "bfloat16"),
    (1, 256, 64, "float32"),
    (8, 16, 128, "float16"),
    (3, 80, 16, "bfloat16"),
]


def case_id(case):
    hkv, d, ps, dtype = case
    return f"hkv{hkv}-d{d}-ps{ps}-{dtype}"


def make_config(case, target):
    hkv, d, ps, dtype = case
    return AttentionConfig(hkv, hkv, d, dtype=dtype, page_size=ps, target=target)


def random_pool(rng, config, num_pages):
    shape = (num_pages, 2, config.num_kv_heads, config.page_size, config.head_dim)
    return randn(rng, shape, config.dtype)


def assert_same(actual, expected, what):
    """Bit-exact equality (copies must not round)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    uint = np.dtype(f"u{expected.dtype.itemsize}")
    mismatch = np.argwhere(np.asarray(actual).view(uint) != np.asarray(expected).view(uint))
    assert mismatch.size == 0, f"{what}: {len(mismatch)} elements differ, first at {tuple(mismatch[0])}"


def split_pos(pos, page_size):
    return pos // page_size, pos % page_size


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_transpose_append(kernels, target, case):
    """Tokens land at their (page, slot) in a shuffled pool; -1 skips; every other slot is kept."""
    config = make_config(case, target)
    hkv, d, ps, dtype = case
    dev = device_for(config)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    n = 37
    num_pages = -(-(n + 9) // ps) + 2
    pool = random_pool(rng, config, num_pages)
    k = randn(rng, (n, hkv, d), dtype)
    v = randn(rng, (n, hkv, d), dtype)
    positions = rng.choice(num_pages * ps, size=n, replace=False).astype(np.int32)
    positions[rng.choice(n, size=6, replace=False)] = -1
    expected = pool.copy()
    for i, pos in enumerate(positions):
        if pos >= 0:
            page, slot = split_pos(pos, ps)
            expected[page, 0, :, slot] = k[i]
            expected[page, 1, :, slot] = v[i]
    pages = tensor(pool, dev)
    kernels.get(transpose_append, config)(pages, tensor(k, dev), tensor(v, dev), index_view(positions, dev))
    assert_same(pages.numpy(), expected, "pages")


def test_transpose_append_no_tokens(kernels, target):
    config = make_config(CASES[0], target)
    dev = device_for(config)
    pool = random_pool(np.random.default_rng(0), config, 3)
    pages = tensor(pool, dev)
    none = np.zeros((0, config.num_kv_heads, config.head_dim), pool.dtype)
    kernels.get(transpose_append, config)(pages, tensor(none, dev), tensor(none, dev),
                                          index_view(np.zeros(0, np.int32), dev))
    assert_same(pages.numpy(), pool, "pages")


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_copy_single_page(kernels, target, case):
    """Slots [0, copy_length) of K and V of every head go from page src to page tgt, nothing else."""
    config = make_config(case, target)
    ps = config.page_size
    dev = device_for(config)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    fn = kernels.get(copy_single_page, config)
    for src, tgt, length in [(3, 1, (ps + 1) // 2), (0, 4, ps), (2, 0, 0), (4, 3, max(ps - 1, 1))]:
        pool = random_pool(rng, config, 5)
        expected = pool.copy()
        expected[tgt, :, :, :length] = pool[src, :, :, :length]
        pages = tensor(pool, dev)
        fn(pages, src, tgt, length)
        assert_same(pages.numpy(), expected, f"pages after copy {src}->{tgt} of {length} slots")


def compaction(slots, kept):
    """Copies that move the tokens at `kept` (increasing) of a request to its first len(kept)
    slots, in order, skipping tokens already in place (as the cache commits a token tree)."""
    return [(slots[j], slots[i]) for i, j in enumerate(kept) if i != j]


def sequential_copies(pool, indptr, src_dst, page_size):
    """The contract's semantics: per request, copies run one after another."""
    out = pool.copy()
    for b in range(len(indptr) - 1):
        for t in range(indptr[b], indptr[b + 1]):
            sp, ss = split_pos(src_dst[0, t], page_size)
            dp, ds = split_pos(src_dst[1, t], page_size)
            out[dp, :, :, ds] = out[sp, :, :, ss]
    return out


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_compact_copy(kernels, target, case):
    """Several requests; a copy's destination is often an earlier copy's source or a later
    copy's source (chains), so the kernel must keep each request's order."""
    config = make_config(case, target)
    ps = config.page_size
    dev = device_for(config)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    lengths = [12, 0, 9, 20, 5]
    pages_per_req = [-(-n // ps) for n in lengths]
    num_pages = sum(pages_per_req) + 2
    order = rng.permutation(num_pages)
    copies, indptr, cursor = [], [0], 0
    for b, (n, npg) in enumerate(zip(lengths, pages_per_req)):
        ids = order[cursor : cursor + npg]
        cursor += npg
        slots = [int(ids[p // ps]) * ps + p % ps for p in range(n)]
        if b == 0:
            request = compaction(slots, [0, 2, 3, 5, 8, 9, 11])
        elif b == 2:
            request = [(slots[0], slots[1]), (slots[1], slots[2]), (slots[2], slots[3]), (slots[8], slots[0])]
        elif b == 3:
            request = compaction(slots, sorted(rng.choice(n, size=11, replace=False).tolist()))
        elif b == 4:
            request = [(slots[4], slots[0]), (slots[0], slots[4])]
        else:
            request = []
        copies += request
        indptr.append(len(copies))
    indptr = np.array(indptr, np.int32)
    src_dst = np.array(copies, np.int32).T.copy()
    pool = random_pool(rng, config, num_pages)
    expected = sequential_copies(pool, indptr, src_dst, ps)
    pages = tensor(pool, dev)
    kernels.get(compact_copy, config)(pages, index_view(indptr, dev), index_view(src_dst, dev, offset=5), len(lengths))
    assert_same(pages.numpy(), expected, "pages")


@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_debug_get_kv(kernels, target, case):
    """k[layer_id], v[layer_id] receive the gathered slots; other layers stay untouched."""
    config = make_config(case, target)
    hkv, d, ps, dtype = case
    dev = device_for(config)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    num_layers, seq_len, num_pages = 3, 29, -(-29 // ps) + 2
    pool = random_pool(rng, config, num_pages)
    positions = rng.choice(num_pages * ps, size=seq_len, replace=False).astype(np.int32)
    page, slot = split_pos(positions, ps)
    fn = kernels.get(debug_get_kv, config, num_layers)
    k = empty((num_layers, seq_len, hkv, d), dtype, dev)
    v = empty((num_layers, seq_len, hkv, d), dtype, dev)
    for layer_id in (2, 1):
        fn(tensor(pool, dev), index_view(positions, dev), k, v, layer_id)
    k_out, v_out = k.numpy(), v.numpy()
    for layer_id in (1, 2):
        assert_same(k_out[layer_id], pool[page, 0, :, slot], f"k of layer {layer_id}")
        assert_same(v_out[layer_id], pool[page, 1, :, slot], f"v of layer {layer_id}")
    assert np.isnan(k_out[0].astype(np.float32)).all() and np.isnan(v_out[0].astype(np.float32)).all(), "layer 0 was written"


def test_debug_get_kv_validation():
    with pytest.raises(ValueError, match="num_layers"):
        debug_get_kv(AttentionConfig(4, 4, 64), 0)


def cuda_source(func, config) -> str:
    """CUDA C of a kernel built for sm_90 (works without a GPU: the source is embedded)."""
    name = str(func.attrs["global_symbol"])
    return tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target()).mod.imports[0].inspect_source()


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize(
    "generator,args",
    [(transpose_append, ()), (copy_single_page, ()), (compact_copy, ()), (debug_get_kv, (4,))],
    ids=["transpose_append", "copy_single_page", "compact_copy", "debug_get_kv"],
)
def test_cuda_codegen(case, generator, args):
    """Every page kernel compiles for CUDA and moves 16 bytes per access."""
    config = make_config(case, "cuda")
    source = cuda_source(generator(config, *args), config)
    vector_type = "float4" if config.dtype == "float32" else "uint4"
    assert f"*({vector_type}*)" in source, f"no 16-byte accesses in\n{source}"

"""paged_decode_tc (tensor-core paged decode, tir_kernels/decode_tc.py) against the float64
reference.

GPU tests build for the present GPU's arch (`cuda:sm_90` on the H200: mma.sync, ldmatrix and
cp.async run there). Page slots no request owns hold NaN, so a kernel that reads past a
request's keys shows it. CPU tests check the CUDA source for sm_80 and sm_90 (no driver, no
nvcc), the signature, the schedule checks and the dispatch of `paged_decode`.
"""

import dataclasses
import re
import zlib

import numpy as np
import pytest
import reference as ref
import tvm
from harness import JUNK, device_for, empty, index_view, make_paged_batch, randn, tensor

from tir_kernels import AttentionConfig, TensorCoreDecodeSchedule, default_sm_scale, paged_decode
from tir_kernels.config import RopeScaling
from tir_kernels.decode_tc import paged_decode_tc
from tir_kernels.schedules import (choose_decode_variant, choose_tc_decode_schedule, decode_schedule_label,
                                   decode_variant_label, decode_variants, load_decode_table, schedule_from_dict,
                                   tc_decode_applies, tc_decode_candidates, tc_decode_problem,
                                   tc_decode_resident_blocks, tc_decode_rope_candidates, tc_decode_rope_schedule)
from tir_kernels.support import present_cuda_arch

# (num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sliding): fp16 and bf16, GQA group
# 3 / 4 / 8 / 16, head dim 64 / 128 / 256, page size 1 / 16 / 64, with and without a window.
CASES = [
    (32, 8, 128, 16, "float16", False),
    (32, 8, 128, 16, "bfloat16", False),
    (16, 4, 128, 1, "float16", False),
    (32, 4, 128, 64, "bfloat16", False),
    (16, 1, 64, 16, "float16", False),
    (8, 2, 64, 1, "bfloat16", True),
    (16, 2, 256, 16, "bfloat16", False),
    (32, 2, 256, 64, "float16", True),
    (64, 4, 128, 16, "float16", True),
    (16, 1, 128, 64, "bfloat16", False),
    (9, 3, 64, 16, "float16", False),  # SmolLM2's heads: 13 of the MMA tile's 16 rows are padding
    (24, 8, 128, 64, "bfloat16", True),
]

# The schedules scripts/tune_decode.py measures (schedules.tc_decode_candidates), on the
# benchmark config (32 q / 8 kv heads, d128, page 16), and explicit ones with few splits.
BENCH_CONFIG = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
SCHEDULES = list(tc_decode_candidates(BENCH_CONFIG).values()) + [
    TensorCoreDecodeSchedule(warps=2, keys_per_warp=32, stages=4, target_blocks=132, max_splits=16),
    TensorCoreDecodeSchedule(warps=4, keys_per_warp=16, stages=3, q_in_registers=False, min_split_keys=64),
]

# The candidates of the group-8 bucket (32 q / 4 kv heads): the table may pick any of them there.
GROUP8_CONFIG = BENCH_CONFIG.replace(num_kv_heads=4)
GROUP8_SCHEDULES = list(tc_decode_candidates(GROUP8_CONFIG).values())

# (early_pages, heads_first, threads_per_row) on every config of CASES (the default schedule of
# each, with these fields): all three on each, each alone on the first.
FLAG_CASES = [(case, (True, True, 8)) for case in CASES] + [(CASES[0], flags) for flags in (
    (True, False, 0), (False, True, 0), (False, False, 16))]




def bucket_heads(group: int) -> tuple:
    """(num_qo_heads, num_kv_heads) of a bucket's group: 32 query heads where the group divides
    32, else 8 KV heads."""
    return (32, 32 // group) if 32 % group == 0 else (8 * group, 8)


# Every schedule the decode table (tir_kernels/decode_table.json) can pick, with a config of its
# bucket: (label, num_qo_heads, num_kv_heads, head_dim, dtype, page_size).
TABLE = load_decode_table()
TABLE_CASES = sorted({(e["schedule"], *bucket_heads(b["group"]), b["head_dim"], b["dtype"], b["page_size"])
                      for b in TABLE.get("buckets", []) for e in b["shapes"]})
# (schedule, rope schedule, ...) of each table entry that names the inline-RoPE build's schedule
TABLE_ROPE_CASES = sorted({(e["schedule"], e["rope_schedule"], *bucket_heads(b["group"]), b["head_dim"],
                            b["dtype"], b["page_size"]) for b in TABLE.get("buckets", []) for e in b["shapes"]
                           if e.get("rope_schedule")})


def case_id(case):
    hq, hkv, d, ps, dtype, sliding = case
    return f"hq{hq}-hkv{hkv}-d{d}-ps{ps}-{dtype}" + ("-sliding" if sliding else "")


def schedule_id(s):
    return s.label


def lengths_for(page_size):
    """Empty history, one key, page-boundary lengths, ragged ones, several tiles, a long one."""
    return [0, 1, page_size, 2 * page_size, 37, 3 * page_size + 5, 130, 64, 65, 1000]


@pytest.fixture(scope="session")
def gpu_target():
    return f"cuda:{present_cuda_arch()}"


def run(kernels, config, batch, q, schedule=None, rotary_mode=0, rope=(1.0, 1e4), q_pos=None, k_pos=None,
        generator=paged_decode_tc):
    dev = device_for(config)
    fn = kernels.get(generator, config, schedule)
    b = batch.batch
    o = empty((b, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((b, config.num_qo_heads), "float32", dev)
    q_pos = np.zeros(b, np.int32) if q_pos is None else q_pos
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
       index_view(batch.page_indices, dev), index_view(batch.length_info(), dev, offset=3),
       index_view(k_pos, dev, offset=11), index_view(q_pos, dev, offset=2), o, lse,
       rotary_mode, rope[0], rope[1], default_sm_scale(config.head_dim))
    return o.numpy().astype(np.float64), lse.numpy()


def inputs(rng, config, lengths):
    batch = make_paged_batch(rng, lengths, config.num_kv_heads, config.head_dim, config.page_size, config.dtype,
                             sliding=config.sliding_window)
    junk = batch.pages.astype(np.float32) == JUNK
    batch.pages[junk] = np.nan  # unowned slots: NaN
    q = randn(rng, (batch.batch, config.num_qo_heads, config.head_dim), config.dtype)
    return batch, q


# Inline RoPE in bfloat16: the kernel's float32 angles (about 1e-3 rad off at positions near
# 1e4) move some rotated elements across a bfloat16 rounding boundary (2^-8 apart) where the
# float64 reference does not, which shifts the LSE by a few thousandths.
ROPE_BF16_LSE_TOLERANCE = (1e-3, 1e-2)


def check(config, batch, q, o, lse, rope=None, q_pos=None, k_pos=None):
    rtol, atol = ref.TOLERANCES[config.dtype]
    lse_tol = ROPE_BF16_LSE_TOLERANCE if rope is not None and config.dtype == "bfloat16" else ref.LSE_TOLERANCE
    for i in range(batch.batch):
        k, v = batch.visible(i)
        qi = q[i : i + 1]
        if rope is not None:  # rotated, then stored in the K/V dtype (as split_rotary would have)
            qi = ref.rope(qi, q_pos[i : i + 1], rope[1], rope[0], config.rope_scaling).astype(q.dtype)
            k = ref.rope(k, k_pos[i] + np.arange(len(k)), rope[1], rope[0], config.rope_scaling).astype(k.dtype)
        eo, else_ = ref.attention(qi, k, v, default_sm_scale(config.head_dim), causal=False)
        np.testing.assert_allclose(o[i], eo[0], rtol=rtol, atol=atol, err_msg=f"o of request {i}")
        np.testing.assert_allclose(lse[i], else_[0], rtol=lse_tol[0], atol=lse_tol[1], err_msg=f"lse of request {i}")


def check_inline_rope(kernels, config, batch, q, schedule, rng, generator=paged_decode_tc):
    """rotary_mode=1 (q and keys RoPE'd in the kernel) at random positions against the
    reference on the rotated q and keys; rope scale 0.5, theta 5e5."""
    q_pos = rng.integers(0, 20000, batch.batch).astype(np.int32)
    k_pos = rng.integers(0, 20000, batch.batch).astype(np.int32)
    rope = (0.5, 5e5)
    o, lse = run(kernels, config, batch, q, schedule, 1, rope, q_pos, k_pos, generator)
    check(config, batch, q, o, lse, rope, q_pos, k_pos)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paged_decode_tc(kernels, gpu_target, case):
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()))
    batch, q = inputs(rng, config, lengths_for(ps))
    o, lse = run(kernels, config, batch, q)
    check(config, batch, q, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size,length", [(1, 3000), (1, 129), (3, 700), (17, 300), (256, 33)])
def test_paged_decode_tc_split_kv(kernels, gpu_target, batch_size, length):
    """Batch 1..256 with ragged lengths: small batches split their keys over blocks (merged
    in FP32), 256 requests take one split each."""
    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target=gpu_target)
    rng = np.random.default_rng(batch_size * 1000 + length)
    lengths = [length + 17 * i if i % 5 != 4 else 0 for i in range(batch_size)]
    batch, q = inputs(rng, config, lengths)
    o, lse = run(kernels, config, batch, q)
    check(config, batch, q, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES, ids=schedule_id)
def test_paged_decode_tc_schedules(kernels, gpu_target, schedule):
    config = BENCH_CONFIG.replace(target=gpu_target)
    for batch_size, lengths in ((1, [2500]), (2, [300, 129]), (9, [0, 1, 16, 63, 64, 65, 200, 1000, 777])):
        rng = np.random.default_rng(batch_size)
        batch, q = inputs(rng, config, lengths)
        o, lse = run(kernels, config, batch, q, schedule)
        check(config, batch, q, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", GROUP8_SCHEDULES, ids=schedule_id)
def test_paged_decode_tc_schedules_group8(kernels, gpu_target, schedule):
    """The candidates of the group-8 bucket (split and unsplit batches, ragged and empty requests)."""
    config = GROUP8_CONFIG.replace(target=gpu_target)
    for batch_size, lengths in ((1, [4100]), (3, [0, 777, 129]), (70, [29 * i + 1 for i in range(70)])):
        rng = np.random.default_rng(batch_size + 8)
        batch, q = inputs(rng, config, lengths)
        o, lse = run(kernels, config, batch, q, schedule)
        check(config, batch, q, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case,flags", FLAG_CASES,
                         ids=lambda x: case_id(x) if len(x) == 6 else "e{}h{}c{}".format(*map(int, x)))
def test_paged_decode_tc_early_pages_heads_first(kernels, gpu_target, case, flags):
    """early_pages (the prologue's page lookups first), heads_first (grid order) and
    threads_per_row (8 or 16 threads a K/V row) on fp16 / bf16, head dims 64 / 128 / 256, page
    sizes 1 / 16 / 64, sliding windows, groups 4 to 16."""
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    sched = dataclasses.replace(choose_tc_decode_schedule(config), early_pages=flags[0], heads_first=flags[1],
                                threads_per_row=flags[2])
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 1)
    batch, q = inputs(rng, config, lengths_for(ps) + [2 * 4096 + 3])
    o, lse = run(kernels, config, batch, q, sched)
    check(config, batch, q, o, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("fanin", [0, 3])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_paged_decode_tc_fused_merge(kernels, gpu_target, case, fanin):
    """fused_merge (the last split block of a request and KV head merges; fanin 3: as a tree of
    runs of 3 splits) on every config of CASES, with splits of at least 16 keys: a request takes
    1 to max_splits splits (some of them empty where the tile rounding leaves no keys; runs of
    one split, one run, up to 22 runs), empty / short / page-boundary lengths; consecutive calls
    with different split counts check that each merging block resets its arrival counters for
    the next call."""
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    sched = dataclasses.replace(choose_tc_decode_schedule(config), min_split_keys=16, early_pages=True,
                                heads_first=True, fused_merge=True, merge_fanin=fanin)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 2)
    for lengths in (lengths_for(ps) + [2 * 4096 + 3], [5000], [0], [3 * ps], [1, 4100], lengths_for(ps)):
        batch, q = inputs(rng, config, lengths)
        o, lse = run(kernels, config, batch, q, sched)
        check(config, batch, q, o, lse)
    if fanin == 0:  # inline RoPE through the same fused merge
        check_inline_rope(kernels, config, batch, q, sched, rng)


# cooperative_merge: every config of CASES at one wave of split slots; the first and the last
# (group 16) also with 16 and 64 waves (grids far larger than the resident blocks: taken where the
# waiting blocks stay fewer than the SMs, e.g. one request; else the last block merges alone).
COOP_CASES = [(case, 1) for case in CASES] + [(case, waves) for case in (CASES[0], CASES[9]) for waves in (16, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("case,waves", COOP_CASES, ids=lambda c: case_id(c) if isinstance(c, tuple) else f"x{c}")
def test_paged_decode_tc_cooperative_merge(kernels, gpu_target, case, waves):
    """cooperative_merge (the last min(nsplit, group) split blocks wait for all and merge a query
    head each) with splits of at least 16 keys: a request takes 1 to max_splits splits (some
    empty), so 1 to group mergers, some merging several heads; empty / short / page-boundary
    lengths; consecutive calls with different split counts check that the counters return to 0."""
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    base = choose_tc_decode_schedule(config)
    sched = dataclasses.replace(base, min_split_keys=16, early_pages=True, heads_first=True, fused_merge=True,
                                cooperative_merge=True, target_blocks=waves * base.target_blocks)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 3 + waves)
    for lengths in (lengths_for(ps) + [2 * 4096 + 3], [5000], [0], [3 * ps], [1, 4100], [40, 300, 9000],
                    lengths_for(ps)):
        batch, q = inputs(rng, config, lengths)
        o, lse = run(kernels, config, batch, q, sched)
        check(config, batch, q, o, lse)


def launch(fn, config, batch, q, rotary_mode=0, rope=(1.0, 1e4), q_pos=None, k_pos=None):
    """One call of a decode kernel on fresh device inputs and NaN outputs, not waited for:
    returns (o, lse) device tensors and the call's arguments."""
    dev = device_for(config)
    b = batch.batch
    o = empty((b, config.num_qo_heads, config.head_dim), config.dtype, dev)
    lse = empty((b, config.num_qo_heads), "float32", dev)
    q_pos = np.zeros(b, np.int32) if q_pos is None else q_pos
    k_pos = np.zeros(b, np.int32) if k_pos is None else k_pos
    args = (tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
            index_view(batch.page_indices, dev), index_view(batch.length_info(), dev, offset=3),
            index_view(k_pos, dev, offset=11), index_view(q_pos, dev, offset=2), o, lse,
            rotary_mode, rope[0], rope[1], default_sm_scale(config.head_dim))
    fn(*args)
    return o, lse, args


# dependent_launch (programmatic dependent launch) with each merge: every config of CASES with the
# cooperative merge, waiting first and with tables_before_wait ("-t"); the first two (fp16 / bf16)
# and the group-16 one also with the fused merge (-f, -f-t) and with the separate merge kernel (two
# launches a call, both dependent).
PDL_CASES = [(case, merge) for case in CASES for merge in ("fc", "fc-t")] + [
    (case, merge) for case in (CASES[0], CASES[1], CASES[9]) for merge in ("f", "split", "f-t")]


@pytest.mark.gpu
@pytest.mark.parametrize("case,merge", PDL_CASES, ids=lambda c: case_id(c) if isinstance(c, tuple) else c)
def test_paged_decode_tc_dependent_launch(kernels, gpu_target, case, merge):
    """dependent_launch: calls issued back to back without a host wait (each call's blocks may be
    scheduled while the previous call runs; each waits at griddepcontrol.wait before its first
    global access), batches of different split counts (1 to max_splits splits of at least 16
    keys, empty / short / page-boundary lengths) one after the other, inline RoPE among them,
    twice round, every call's result checked; so a call that read another's partials, counters
    or inputs early, or a counter left non-zero, shows."""
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding)
    sched = dataclasses.replace(choose_tc_decode_schedule(config), min_split_keys=16, early_pages=True,
                                heads_first=True, fused_merge=merge != "split",
                                cooperative_merge=merge.startswith("fc"), dependent_launch=True,
                                tables_before_wait=merge.endswith("-t"))
    assert sched.label.endswith("-pdlt" if merge.endswith("-t") else "-pdl")
    fn = kernels.get(paged_decode_tc, config, sched)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 4)
    rope = (0.5, 5e5)
    work = []
    for lengths in (lengths_for(ps) + [2 * 4096 + 3], [5000], [0], [3 * ps], [1, 4100], [40, 300, 9000]):
        batch, q = inputs(rng, config, lengths)
        pos = rng.integers(0, 20000, (2, batch.batch)).astype(np.int32)
        work.append((batch, q, (pos[0], pos[1])))
    calls = []
    for _ in range(2):
        for i, (batch, q, (q_pos, k_pos)) in enumerate(work):
            roped = i % 3 == 2
            o, lse, _ = launch(fn, config, batch, q, int(roped), rope, q_pos, k_pos)
            calls.append((batch, q, o, lse, roped, q_pos, k_pos))
    for batch, q, o, lse, roped, q_pos, k_pos in calls:
        check(config, batch, q, o.numpy().astype(np.float64), lse.numpy(), rope if roped else None, q_pos, k_pos)


@pytest.mark.gpu
@pytest.mark.parametrize("tables_before_wait", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_decode_tc_dependent_launch_graph(kernels, gpu_target, dtype, tables_before_wait):
    """dependent_launch inside a CUDA graph (torch's capture stream, TVM's launches on it through
    tvm_ffi.use_torch_stream): calls of one split, of 64 splits (cooperative merge) and of a
    batch, captured in order and replayed three times, outputs poisoned before each replay."""
    torch = pytest.importorskip("torch")
    import tvm_ffi

    config = AttentionConfig(32, 4, 128, dtype=dtype, page_size=16, target=gpu_target)
    sched = dataclasses.replace(choose_tc_decode_schedule(config), threads_per_row=8, early_pages=True,
                                heads_first=True, fused_merge=True, cooperative_merge=True, dependent_launch=True,
                                tables_before_wait=tables_before_wait)
    fn = kernels.get(paged_decode_tc, config, sched)
    rng = np.random.default_rng(12)
    work = [inputs(rng, config, lengths) for lengths in ([100], [32768], [7, 3000, 129, 0, 777], [32000])]
    calls = [launch(fn, config, batch, q) for batch, q in work]  # eager first (also builds the workspace)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        for _, _, args in calls:
            fn(*args)
    for _ in range(3):
        for _, _, args in calls:
            for out in args[7:9]:
                out.copyfrom(np.full(out.shape, np.nan, dtype=out.numpy().dtype))
        graph.replay()
        torch.cuda.synchronize()
        for (batch, q), (o, lse, _) in zip(work, calls):
            check(config, batch, q, o.numpy().astype(np.float64), lse.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_table_schedules(kernels, gpu_target, case):
    """Each schedule the table can pick, on its bucket's config and on the other 16-bit dtype,
    for batches that take one split and several (ragged lengths, empty requests)."""
    label, hq, kv, d, dtype, ps = case
    sched = schedule_from_dict(TABLE["schedules"][label])
    for dt in (dtype, "bfloat16" if dtype == "float16" else "float16"):
        config = AttentionConfig(hq, kv, d, dtype=dt, page_size=ps, target=gpu_target)
        for batch_size, lengths in ((1, [3000]), (5, [0, 1, 129, 700, 2049]), (40, [33 * i + 7 for i in range(40)])):
            rng = np.random.default_rng(batch_size + kv)
            batch, q = inputs(rng, config, lengths)
            fn = kernels.get(paged_decode, config, sched)
            dev = device_for(config)
            o = empty((batch.batch, config.num_qo_heads, d), config.dtype, dev)
            lse = empty((batch.batch, config.num_qo_heads), "float32", dev)
            zeros = np.zeros(batch.batch, np.int32)
            fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
               index_view(batch.page_indices, dev), index_view(batch.length_info(), dev), index_view(zeros, dev),
               index_view(zeros, dev), o, lse, 0, 1.0, 1e4, default_sm_scale(d))
            check(config, batch, q, o.numpy().astype(np.float64), lse.numpy())
            if batch_size < 40:
                check_inline_rope(kernels, config, batch, q, sched, rng, paged_decode)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TABLE_ROPE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_table_rope_schedules(kernels, gpu_target, case):
    """Each (schedule, rope schedule) pair the table names, built into one function on its
    bucket's config and on the other 16-bit dtype: rotary_mode=1 (the rope build) and 0 (the
    plain build beside it) on a batch-1 request of one split and of many (4096, 32768 keys), and
    on ragged batches with empty and page-boundary lengths."""
    plain_label, rope_label, hq, kv, d, dtype, ps = case
    pair = (schedule_from_dict(TABLE["schedules"][plain_label]), schedule_from_dict(TABLE["schedules"][rope_label]))
    for dt in (dtype, "bfloat16" if dtype == "float16" else "float16"):
        config = AttentionConfig(hq, kv, d, dtype=dt, page_size=ps, target=gpu_target)
        for lengths in ([4096], [32768], [100], [0, 1, 129, 700, 2049], [33 * i + 7 for i in range(12)]):
            rng = np.random.default_rng(len(lengths) + kv + lengths[0])
            batch, q = inputs(rng, config, lengths)
            o, lse = run(kernels, config, batch, q, pair, generator=decode_tc_with_rope_schedule)
            check(config, batch, q, o, lse)
            check_inline_rope(kernels, config, batch, q, pair, rng, decode_tc_with_rope_schedule)



# Every (schedule, rope schedule or None) the table can pick, for its sliding-window build.
TABLE_WINDOW_CASES = sorted({(e["schedule"], e.get("rope_schedule") or "", *bucket_heads(b["group"]),
                              b["head_dim"], b["dtype"], b["page_size"])
                             for b in TABLE.get("buckets", []) for e in b["shapes"]})

# (length, sink, window offset) of the requests of test_decode_table_window_schedules: the
# benchmark's window (page 0's 4 sinks, then from slot 3 of a page: tiles shifted off key 0 by
# page_shift), windows starting on and off page boundaries with and without sinks, a request
# that sees only its sinks (no shift), and an empty one.
WINDOW_REQUESTS = [(3600, 4, 19), (4096, 0, 515), (2049, 3, 16), (700, 4, 37), (130, 2, 2), (3, 3, 3), (0, 0, 0),
                   (1000, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TABLE_WINDOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_table_window_schedules(kernels, gpu_target, case):
    """The sliding-window build (length_info [3, B]) of each schedule the table can pick, with
    its rope schedule (or the default one), on its bucket's config and the other 16-bit dtype:
    windows that start mid-page after sinks (split 0's first tile then starts before key 0,
    decode_tc's page_shift), on page boundaries, sinks only; one request alone (many splits)
    and all of them in one batch; rotary_mode 0 and 1."""
    plain_label, rope_label, hq, kv, d, dtype, ps = case
    sched = schedule_from_dict(TABLE["schedules"][plain_label])
    rope = schedule_from_dict(TABLE["schedules"][rope_label]) if rope_label else tc_decode_rope_schedule(
        BENCH_CONFIG.replace(num_qo_heads=hq, num_kv_heads=kv, head_dim=d, page_size=ps), sched)
    for dt in (dtype, "bfloat16" if dtype == "float16" else "float16"):
        config = AttentionConfig(hq, kv, d, dtype=dt, page_size=ps, target=gpu_target, sliding_window=True)
        for requests in (WINDOW_REQUESTS[:1], WINDOW_REQUESTS[1:2], WINDOW_REQUESTS):
            rng = np.random.default_rng(len(requests) + kv)
            batch, q = inputs(rng, config, [n for n, _, _ in requests])
            batch.sink = np.array([s for _, s, _ in requests], np.int32)
            batch.window_offset = np.array([w for _, _, w in requests], np.int32)
            o, lse = run(kernels, config, batch, q, (sched, rope), generator=decode_tc_with_rope_schedule)
            check(config, batch, q, o, lse)
            check_inline_rope(kernels, config, batch, q, (sched, rope), rng, decode_tc_with_rope_schedule)

# Inline RoPE (rotary_mode=1, tensor cores) on every config of CASES and with Llama-3 frequency
# scaling.
ROPE_CASES = [(case, None) for case in CASES] + [(CASES[0], RopeScaling(8.0, 1.0, 4.0, 8192)),
                                                 (CASES[6], RopeScaling(32.0, 1.0, 4.0, 8192))]


@pytest.mark.gpu
@pytest.mark.parametrize("case,scaling", ROPE_CASES,
                         ids=lambda x: case_id(x) if isinstance(x, tuple) else ("llama3" if x else "plain"))
def test_paged_decode_tc_inline_rope(kernels, gpu_target, case, scaling):
    """rotary_mode=1: the tensor-core kernel rotates q and each K tile in shared memory (exact
    angles every 8 tiles, advanced row to row between): ragged, empty and page-boundary lengths, a long
    request (many tiles, several splits), positions up to 32000."""
    hq, hkv, d, ps, dtype, sliding = case
    config = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=gpu_target, sliding_window=sliding,
                             rope_scaling=scaling)
    rng = np.random.default_rng(zlib.crc32(case_id(case).encode()) + 3)
    batch, q = inputs(rng, config, lengths_for(ps) + [3 * 4096 + 5])
    check_inline_rope(kernels, config, batch, q, None, rng)


def decode_tc_with_rope_schedule(config, schedules):
    """paged_decode_tc with (plain schedule, rope schedule)."""
    return paged_decode_tc(config, *schedules)


def rope_schedule_cases():
    """(name, plain schedule, rope schedule) on the benchmark config: the rope build's own
    chunks (threads_per_row 8 at d128: warp-wise copies, ROPE_OWN) at 2 stages; the other copy
    mapping (rotating tile t + 1 a step ahead at 4 stages, tile t behind a second barrier at 2); a
    rope build with another
    split grid than the plain one's (its own merge kernel, the plain build's fused merge)."""
    base = choose_tc_decode_schedule(BENCH_CONFIG)
    flags = dict(threads_per_row=8, early_pages=True, heads_first=True)
    return [
        ("own-s2", base, dataclasses.replace(base, stages=2, **flags)),
        ("ahead-s4", base, dataclasses.replace(base, threads_per_row=4)),
        ("behind-s2", base, dataclasses.replace(base, stages=2, threads_per_row=4)),
        ("own-grid", dataclasses.replace(base, fused_merge=True, **flags),
         dataclasses.replace(base, stages=3, target_blocks=2 * base.target_blocks, min_split_keys=256, **flags)),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,plain,rope", rope_schedule_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_paged_decode_tc_inline_rope_schedules(kernels, gpu_target, dtype, name, plain, rope):
    """rotary_mode=1 built with a rope schedule of its own beside the plain one (32 q / 8 kv
    heads, d128, page 16): both rotation orders, and a rope build that splits and merges
    differently from the plain build of the same function; the plain build still correct."""
    config = BENCH_CONFIG.replace(dtype=dtype, target=gpu_target)
    rng = np.random.default_rng(zlib.crc32(f"{name}-{dtype}".encode()))
    batch, q = inputs(rng, config, lengths_for(16) + [3 * 4096 + 5, 700])
    o, lse = run(kernels, config, batch, q, (plain, rope), generator=decode_tc_with_rope_schedule)
    check(config, batch, q, o, lse)
    check_inline_rope(kernels, config, batch, q, (plain, rope), rng, decode_tc_with_rope_schedule)


def test_tc_decode_rope_schedule():
    """The rope build copies half a row's chunks per thread (each thread then rotates its own
    copies): 8 threads a row at head dim 128, 4 at 64, 16 at 256; all else unchanged."""
    base = choose_tc_decode_schedule(BENCH_CONFIG)
    for d, tpr in ((64, 4), (128, 8), (256, 16)):
        config = BENCH_CONFIG.replace(head_dim=d, v_head_dim=d)
        sched = choose_tc_decode_schedule(config)
        assert tc_decode_rope_schedule(config, sched) == dataclasses.replace(sched, threads_per_row=tpr)
    flagged = dataclasses.replace(base, threads_per_row=8, fused_merge=True, early_pages=True)
    assert tc_decode_rope_schedule(BENCH_CONFIG, flagged) is flagged


def test_paged_decode_tc_rope_schedule_launch_must_match():
    """A rope schedule whose dependent launch differs from the plain schedule's is refused (the
    PrimFunc's kernels share one launch: a rope kernel launched dependently must wait)."""
    config = BENCH_CONFIG.replace(num_kv_heads=4)
    plain = dataclasses.replace(choose_tc_decode_schedule(config), threads_per_row=8, early_pages=True)
    pdl = dataclasses.replace(plain, dependent_launch=True)
    for sched, rope in ((pdl, plain), (plain, pdl)):
        with pytest.raises(ValueError, match="rope_schedule: dependent_launch"):
            paged_decode_tc(config, sched, rope_schedule=rope)


@pytest.mark.gpu
def test_paged_decode_dispatches_to_tensor_cores(kernels, gpu_target):
    """paged_decode(config) of a group of 8 in bf16 is the tensor-core kernel (while the
    dispatch is on), and correct."""
    from tir_kernels import decode

    config = AttentionConfig(32, 4, 128, dtype="bfloat16", page_size=16, target=gpu_target)
    assert ("mma" in str(paged_decode(config))) == (decode.TENSOR_CORE_DECODE and tc_decode_applies(config))
    rng = np.random.default_rng(9)
    batch, q = inputs(rng, config, [0, 100, 4000, 33])
    fn = kernels.get(paged_decode, config)
    dev = device_for(config)
    o = empty((batch.batch, config.num_qo_heads, 128), config.dtype, dev)
    lse = empty((batch.batch, config.num_qo_heads), "float32", dev)
    zeros = np.zeros(batch.batch, np.int32)
    fn(tensor(q, dev), tensor(batch.pages, dev), index_view(batch.page_indptr, dev),
       index_view(batch.page_indices, dev), index_view(batch.length_info(), dev), index_view(zeros, dev),
       index_view(zeros, dev), o, lse, 0, 1.0, 1e4, default_sm_scale(128))
    check(config, batch, q, o.numpy().astype(np.float64), lse.numpy())


def signature(func):
    def describe(p):
        if type(p.ty).__name__ == "BufferType":
            return p.name, str(p.dtype), str(p.shape), str(p.elem_offset)
        return p.name, str(p.ty)
    return [describe(p) for p in func.params]


@pytest.mark.parametrize("config", [
    pytest.param(AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90"), marks=pytest.mark.slow),
    pytest.param(AttentionConfig(16, 1, 256, dtype="bfloat16", page_size=1, target="cuda:sm_80", sliding_window=True),
                 marks=pytest.mark.slow),
    AttentionConfig(16, 4, 64, dtype="float16", page_size=64, target="cuda:sm_89"),
], ids=["fp16-d128-sm90", "bf16-d256-g16-sliding-sm80", "fp16-d64-sm89"])
def test_decode_tc_builds_cuda_source(config):
    """Same signature and symbol as the CUDA-core decode; mma.sync m16n8k16 with fp32
    accumulation, ldmatrix (.trans for V) and 16-byte cp.async in the source."""
    func, core = paged_decode_tc(config), paged_decode(config.replace(target="llvm"))
    assert func.attrs["global_symbol"] == core.attrs["global_symbol"]
    assert signature(func) == signature(core)
    module = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": func}), target=config.tvm_target())
    cuda = module.mod.imports[0].inspect_source()
    mma = "bf16" if config.dtype == "bfloat16" else "f16"
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32" in cuda
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in cuda
    assert "cp.async.cg.shared.global [%0], [%1], 16;" in cuda


@pytest.mark.slow
def test_decode_tc_fused_merge_source():
    """fused_merge: no merge kernel (one kernel fewer in the module), an arrival counter per
    (request, KV head) slot of one launch (target_blocks of them) counted with atomicAdd."""
    config = AttentionConfig(32, 4, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    base = dataclasses.replace(choose_tc_decode_schedule(config), early_pages=True, heads_first=True)

    def kernel_source(sched):
        module = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": paged_decode_tc(config, sched)}),
                             target=config.tvm_target())
        return module.mod.imports[0].inspect_source()

    split, fused = kernel_source(base), kernel_source(dataclasses.replace(base, fused_merge=True))
    assert split.count('extern "C" __global__') == fused.count('extern "C" __global__') + 2  # declaration + definition
    assert "atomicAdd" not in split and "atomicAdd(&tvmattn_decode_arrivals_" in fused
    assert f"__device__ unsigned tvmattn_decode_arrivals_{base.target_blocks}[{base.target_blocks}];" in fused
    assert dataclasses.replace(base, fused_merge=True).label == base.label + "-f"
    tree = kernel_source(dataclasses.replace(base, fused_merge=True, merge_fanin=6))
    assert tree.count('extern "C" __global__') == fused.count('extern "C" __global__')
    n = base.target_blocks
    assert f"__device__ unsigned tvmattn_decode_arrivals_{n}[{n}];" in tree
    assert f"__device__ unsigned tvmattn_decode_arrivalsruns_{n}[{n}];" in tree  # the second level's counters
    assert "tvmattn_decode_arrivalsruns" not in fused
    assert dataclasses.replace(base, fused_merge=True, merge_fanin=6).label == base.label + "-f6"
    coop = kernel_source(dataclasses.replace(base, fused_merge=True, cooperative_merge=True))
    assert coop.count('extern "C" __global__') == fused.count('extern "C" __global__')
    assert f"__device__ unsigned tvmattn_decode_arrivalsc_{n}[{n}];" in coop  # the cooperative counters
    assert "__nanosleep" in coop and "%%nsmid" in coop and "__nanosleep" not in fused
    assert "tvmattn_decode_arrivals_" not in coop  # one arrival function, whoever merges
    assert dataclasses.replace(base, fused_merge=True, cooperative_merge=True).label == base.label + "-fc"


@pytest.mark.slow
def test_decode_tc_dependent_launch_source():
    """dependent_launch: every kernel of the module waits (griddepcontrol.wait) before its first
    global load and the decode kernels let the next launch start once their prologue is issued;
    the pipeline puts TVM's launch tag among each kernel's launch parameters, before the dynamic
    shared memory tag (which the runtime requires last); sm_80 refuses it."""
    from tir_kernels.build import PIPELINE, _mixed_pipeline
    from tir_kernels.common import PDL_TAG

    config = AttentionConfig(32, 4, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    base = dataclasses.replace(choose_tc_decode_schedule(config), early_pages=True, heads_first=True)
    for merge in ({"fused_merge": True, "cooperative_merge": True}, {}):
        sched = dataclasses.replace(base, dependent_launch=True, **merge)
        assert sched.label == dataclasses.replace(base, **merge).label + "-pdl"
        func = paged_decode_tc(config, sched)
        assert bool(func.attrs[PDL_TAG])
        cuda = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": func}), target=config.tvm_target(),
                           tir_pipeline=PIPELINE).mod.imports[0].inspect_source()
        kernels_src = cuda.split('extern "C" __global__')[1:]
        bodies = [k for k in kernels_src if "{" in k.split(";")[0]]  # definitions, not declarations
        assert len(bodies) == (2 if merge else 3)  # plain and inline-RoPE decode (+ the merge kernel)
        for body in bodies:
            wait = body.index("tvmattn_grid_dependency_wait();")
            pointers = re.findall(r"\*\s*(?:__restrict__\s+)?(\w+)\s*[,)]", body[:body.index("{")])
            assert pointers and not [p for p in pointers if p in body[body.index("{"):wait]]  # none touched before
        assert cuda.count("griddepcontrol.wait;") == 1 and cuda.count("griddepcontrol.launch_dependents;") == 1
        assert sum("tvmattn_launch_dependents();" in body for body in bodies) == 2  # the decode kernels
        lowered = _mixed_pipeline()[0](tvm.IRModule({"batch_decode_paged_kv": func.with_attr(
            "target", tvm.target.Target(config.tvm_target(), host="llvm"))}))
        tags = {gv.name_hint: [str(t) for t in f.attrs["tirx.kernel_launch_params"]]
                for gv, f in lowered.functions_items() if f.attrs.get("tirx.kernel_launch_params") is not None}
        assert len(tags) == len(bodies)
        for params in tags.values():
            assert PDL_TAG in params
            assert "tirx.use_dyn_shared_memory" not in params[:-1]  # last where present (decode kernels)
    early = dataclasses.replace(base, fused_merge=True, cooperative_merge=True, dependent_launch=True,
                                tables_before_wait=True)
    assert early.label.endswith("-fc-pdlt")
    cuda = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": paged_decode_tc(config, early)}),
                       target=config.tvm_target(), tir_pipeline=PIPELINE).mod.imports[0].inspect_source()
    for body in [k for k in cuda.split('extern "C" __global__')[1:] if "{" in k.split(";")[0]]:
        before = body[body.index("{"):body.index("tvmattn_grid_dependency_wait();")]
        assert "page_indices_ptr[" in before and "length_info_ptr[" in before  # the tables before the wait
        assert not [p for p in ("Q_ptr", "pages_ptr", "O_ptr", "lse_ptr", "cp.async") if p in before]
    with pytest.raises(ValueError, match="tables_before_wait needs"):
        dataclasses.replace(base, tables_before_wait=True)
    plain = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": paged_decode_tc(config, base)}),
                        target=config.tvm_target(), tir_pipeline=PIPELINE).mod.imports[0].inspect_source()
    assert "griddepcontrol" not in plain
    with pytest.raises(ValueError, match="dependent_launch"):
        dataclasses.replace(base, dependent_launch=True).check(config.replace(target="cuda:sm_80"))


@pytest.mark.slow
def test_decode_tc_early_pages_heads_first_source():
    """heads_first: blockIdx.x is the KV head and blockIdx.z the request (page_indptr is read at
    blockIdx.z); early_pages: every page-table read of the prologue (PASSES * (stages - 1) of
    them) comes before the first K/V copy; without it the reads and copies alternate;
    threads_per_row sets the page-table reads per tile (one per row a thread copies)."""
    config = AttentionConfig(32, 4, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    base = choose_tc_decode_schedule(config)

    def kernel_source(sched):
        """The tensor-core kernel's body (the definition with mma.sync in it)."""
        module = tvm.compile(tvm.IRModule({"batch_decode_paged_kv": paged_decode_tc(config, sched)}),
                             target=config.tvm_target())
        defs = module.mod.imports[0].inspect_source().split('extern "C" __global__')
        bodies = [d for d in defs[1:] if d.split("\n", 1)[0].rstrip().endswith("{")]
        return next(d for d in bodies if "ldmatrix" in d and "tvmattn_rope_chunks" not in d)  # the plain build

    def prologue_order(src):
        """'L' per page-table read, 'C' per K/V cp.async, in source order up to the main loop."""
        src = src[:src.find("for (int t = 0;")]
        events = sorted([(i, "L") for i in range(len(src)) if src.startswith("page_indices_ptr[", i)]
                        + [(i, "C") for i in range(len(src)) if src.startswith("(&(pages_ptr[", i)])
        return "".join(e for _, e in events)

    flagged = kernel_source(dataclasses.replace(base, early_pages=True, heads_first=True))
    plain = kernel_source(base)
    assert "page_indptr_ptr[(((int)blockIdx.z)" in flagged and "page_indptr_ptr[(((int)blockIdx.x)" in plain
    passes = 2  # 64-key tiles, 32 rows per pass of 128 threads
    early, late = prologue_order(flagged), prologue_order(plain)
    assert early.startswith("L" * passes * (base.stages - 1) + "C"), early[:20]
    assert late.startswith("L" * passes + "C"), late[:20]
    assert "L" * passes * (base.stages - 1) not in late.split("C", 1)[0]
    # 8 threads a row: 16 rows a pass, 4 passes (page-table reads) per 64-key tile
    wide = prologue_order(kernel_source(dataclasses.replace(base, early_pages=True, threads_per_row=8)))
    assert wide.startswith("L" * 4 * (base.stages - 1) + "C"), wide[:20]


def test_tc_decode_schedule_validation():
    with pytest.raises(ValueError, match="keys_per_warp"):
        TensorCoreDecodeSchedule(keys_per_warp=24)
    with pytest.raises(ValueError, match="stages"):
        TensorCoreDecodeSchedule(stages=1)
    with pytest.raises(ValueError, match="warps"):
        TensorCoreDecodeSchedule(warps=0)
    with pytest.raises(ValueError, match="threads_per_row"):
        TensorCoreDecodeSchedule(threads_per_row=3)
    with pytest.raises(ValueError, match="merge_fanin=4 must be 0, or 2..max_splits=64 with fused_merge"):
        TensorCoreDecodeSchedule(merge_fanin=4)
    for fanin in (1, 65, -2):
        with pytest.raises(ValueError, match=f"merge_fanin={fanin}"):
            TensorCoreDecodeSchedule(fused_merge=True, merge_fanin=fanin)
    with pytest.raises(ValueError, match="cooperative_merge needs fused_merge=True and merge_fanin=0"):
        TensorCoreDecodeSchedule(cooperative_merge=True)
    with pytest.raises(ValueError, match="cooperative_merge needs"):
        TensorCoreDecodeSchedule(fused_merge=True, merge_fanin=3, cooperative_merge=True)
    cuda = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_tc(cuda.replace(dtype="float32"))
    with pytest.raises(ValueError, match="target"):
        paged_decode_tc(cuda.replace(target="llvm"))
    with pytest.raises(ValueError, match="sm_80"):
        paged_decode_tc(cuda.replace(target="cuda:sm_75"))
    with pytest.raises(ValueError, match="GQA group"):
        paged_decode_tc(AttentionConfig(64, 2, 128, dtype="float16", target="cuda:sm_90"))
    with pytest.raises(ValueError, match="shared memory"):
        paged_decode_tc(cuda, TensorCoreDecodeSchedule(warps=8, keys_per_warp=32, stages=4))
    with pytest.raises(ValueError, match="threads_per_row=16 must divide the 8"):
        paged_decode_tc(cuda.replace(head_dim=64, v_head_dim=64), TensorCoreDecodeSchedule(threads_per_row=16))
    with pytest.raises(ValueError, match="fragment registers"):
        paged_decode_tc(cuda.replace(head_dim=256, v_head_dim=256),
                        TensorCoreDecodeSchedule(keys_per_warp=64, q_in_registers=True))


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_tc_decode_schedules_fit(arch, dtype):
    """The default schedule is valid for every config the dispatch sends to tensor cores: head
    dims 32, 64, 128 and 256 (the others' rows the inline RoPE cannot rotate in whole passes)."""
    served = set()
    for d in range(16, 257, 16):
        for hq, hkv in ((16, 4), (32, 4), (16, 1), (32, 2)):
            config = AttentionConfig(hq, hkv, d, dtype=dtype, target=f"cuda:{arch}")
            if tc_decode_applies(config):
                choose_tc_decode_schedule(config).check(config)
                served.add(d)
            else:
                assert "inline RoPE" in tc_decode_problem(config)
    assert served == {32, 64, 128, 256}


@pytest.mark.slow
def test_tc_decode_dispatch():
    """paged_decode picks the tensor-core kernel for fp16/bf16 groups of 3..16 on CUDA sm_80+
    and the CUDA-core kernel for small groups, fp32, older archs and the CPU."""
    from tir_kernels import decode

    def uses_mma(config):
        return "ptx.mma" in str(paged_decode(config)) or "mma.sync" in str(paged_decode(config))

    base = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    assert uses_mma(base) == decode.TENSOR_CORE_DECODE
    assert uses_mma(base.replace(dtype="bfloat16", num_kv_heads=2)) == decode.TENSOR_CORE_DECODE
    assert uses_mma(AttentionConfig(9, 3, 64, dtype="float16", page_size=16, target="cuda:sm_90")) == \
        decode.TENSOR_CORE_DECODE  # group 3
    assert not uses_mma(base.replace(num_kv_heads=16))  # group 2
    assert not uses_mma(base.replace(dtype="float32"))
    assert not uses_mma(base.replace(target="cuda:sm_75"))
    assert not uses_mma(base.replace(target="llvm"))


def test_decode_table_file():
    """The committed table: its schedules are valid for their buckets' configs and are among the
    candidates the GPU tests run (test_paged_decode_tc_schedules runs the candidates of the
    benchmark config; test_decode_table_schedules each table schedule on its bucket)."""
    assert TABLE, "tir_kernels/decode_table.json is missing"
    assert TABLE["arch"] == "sm_90" and TABLE["buckets"]
    for label, hq, kv, d, dtype, ps in TABLE_CASES:
        config = AttentionConfig(hq, kv, d, dtype=dtype, page_size=ps, target="cuda:sm_90")
        sched = schedule_from_dict(TABLE["schedules"][label])
        assert decode_schedule_label(sched) == label
        sched.check(config)
        assert label in tc_decode_candidates(config)
    for b in TABLE["buckets"]:
        assert {e["schedule"] for e in b["shapes"]} <= set(TABLE["schedules"])
    # rope schedules: valid for the bucket, among the rope candidates, the entry's launch kept,
    # and each pair taken by the lookup (test_decode_table_rope_schedules runs them on the GPU)
    assert TABLE_ROPE_CASES, "the table names no rope schedule"
    for plain_label, rope_label, hq, kv, d, dtype, ps in TABLE_ROPE_CASES:
        config = AttentionConfig(hq, kv, d, dtype=dtype, page_size=ps, target="cuda:sm_90")
        plain, rope = (schedule_from_dict(TABLE["schedules"][lab]) for lab in (plain_label, rope_label))
        rope.check(config)
        assert rope_label in tc_decode_rope_candidates(config) and rope.dependent_launch == plain.dependent_launch
        assert (plain, rope) in [(s, r) for s, r, _ in decode_variants(config, TABLE)]


def _table(entries, group=4, dtype="float16", head_dim=128, rope=None):
    """A table of one bucket: entries [(batch, seq_len, schedule)], rope {(batch, seq_len): rope
    schedule}."""
    schedules = {}
    shapes = []
    for batch, seq_len, sched in entries:
        schedules[decode_schedule_label(sched)] = {"kind": "tensor-core", **dataclasses.asdict(sched)}
        shapes.append({"batch": batch, "seq_len": seq_len, "schedule": decode_schedule_label(sched)})
        rope_sched = (rope or {}).get((batch, seq_len))
        if rope_sched is not None:
            schedules[rope_sched.label] = {"kind": "tensor-core", **dataclasses.asdict(rope_sched)}
            shapes[-1]["rope_schedule"] = rope_sched.label
    return {"arch": "sm_90", "sms": 132, "schedules": schedules,
            "buckets": [{"dtype": dtype, "head_dim": head_dim, "group": group, "page_size": 16, "shapes": shapes}]}


def test_decode_table_lookup():
    """Nearest bucket (head dim exact, arch exact, other 16-bit dtype and nearest group as
    fallbacks), nearest shape in log2 space; the defaults without an entry."""
    a = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=128)
    b = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=512, l2_prefetch=256)
    table = _table([(1, 4096, a), (1, 32768, b), (64, 4096, a), (16, 32768, b)])
    g4 = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    assert choose_decode_variant(g4, 1, 3000, table) == a
    assert choose_decode_variant(g4, 1, 30000, table) == b
    assert choose_decode_variant(g4, 4, 40000, table) == b
    assert choose_decode_variant(g4, 200, 2048, table) == a
    assert choose_decode_variant(g4, table=table) == b  # no shape: the largest (16 x 32768)
    assert choose_decode_variant(g4.replace(dtype="bfloat16"), 1, 30000, table) == b
    assert choose_decode_variant(g4.replace(num_kv_heads=4), 1, 30000, table) == b  # group 8 -> bucket 4
    assert [s for s, _, _ in decode_variants(g4, table)] == [a, b]
    assert decode_variants(g4, table)[1] == (b, None, [(1, 32768), (16, 32768)])
    # not served by the table: other arch, head dim, the CPU, groups the tensor cores do not take
    for config in (g4.replace(target="cuda:sm_80"), g4.replace(head_dim=64, v_head_dim=64),
                   g4.replace(target="llvm"), g4.replace(num_kv_heads=32)):
        assert decode_variants(config, table) == [(choose_decode_variant(config, table={}), None, [])]
    assert choose_decode_variant(g4.replace(target="cuda:sm_80"), 1, 100, table) == choose_tc_decode_schedule(
        g4.replace(target="cuda:sm_80"))


def test_decode_table_rope_lookup():
    """An entry's "rope_schedule": the same plain schedule with two rope schedules is two
    variants; the lookup returns the entry's pair; a rope schedule that changes the launch or
    does not fit the config is dropped (None: decode_tc's default)."""
    a = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=128, threads_per_row=8,
                                 dependent_launch=True)
    r1 = dataclasses.replace(a, stages=2, target_blocks=396, cooperative_merge=True, fused_merge=True)
    r2 = dataclasses.replace(a, stages=3, target_blocks=264)
    off = dataclasses.replace(r2, dependent_launch=False)
    wide = dataclasses.replace(r2, stages=8)  # more shared memory than an H200 block has
    table = _table([(1, 4096, a), (1, 32768, a), (64, 4096, a), (128, 8192, a)],
                   rope={(1, 4096): r1, (1, 32768): r2, (64, 4096): off, (128, 8192): wide})
    g4 = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    assert decode_variants(g4, table) == [(a, r1, [(1, 4096)]), (a, r2, [(1, 32768)]),
                                          (a, None, [(64, 4096), (128, 8192)])]
    assert choose_decode_variant(g4, 1, 3000, table, rope=True) == (a, r1)
    assert choose_decode_variant(g4, 1, 3000, table) == a
    assert choose_decode_variant(g4, table=table, rope=True) == (a, None)  # the largest shape, 128 x 8192
    assert choose_decode_variant(g4, 1, 30000, table={}, rope=True) == (choose_tc_decode_schedule(g4), None)
    assert decode_variant_label(a, r1) == f"{a.label}+rope:{r1.label}" and decode_variant_label(a) == a.label


def test_tc_decode_rope_candidates():
    """The rope candidates: each rotates its own copies (threads_per_row = D / 16, so the rope
    build's schedule is the candidate itself), launches dependently, fits the config, and its
    target_blocks is a whole number of waves of its resident blocks."""
    for kv in (4, 8):
        config = BENCH_CONFIG.replace(num_kv_heads=kv)
        candidates = tc_decode_rope_candidates(config)
        assert len(candidates) >= 12
        for label, sched in candidates.items():
            assert sched.label == label and sched.dependent_launch and sched.fused_merge
            assert tc_decode_rope_schedule(config, sched) == sched
            sched.check(config)
            assert sched.target_blocks % (132 * tc_decode_resident_blocks(config, sched)) == 0
    assert tc_decode_rope_candidates(BENCH_CONFIG.replace(head_dim=48, v_head_dim=48)) == {}  # 3 chunks a half row


def test_decode_by_shape_picks_on_the_host():
    """The cache's decode over several compiled variants runs the one of the nearest table
    shape, estimating the context from the page-index count."""
    from types import SimpleNamespace

    from tvmattn.runtime.kernels import DecodeByShape

    calls = []

    def variant(name):
        return lambda *args: calls.append((name, len(args)))

    fn = DecodeByShape([(variant("short"), [(1, 4096), (64, 4096)]), (variant("long"), [(1, 32768)])], page_size=16)

    def call(batch, pages):
        fn(SimpleNamespace(shape=(batch, 32, 128)), None, None, SimpleNamespace(shape=(pages,)), *range(9))
        return calls[-1]

    assert call(1, 256) == ("short", 13)  # 4096 keys
    assert call(1, 2048) == ("long", 13)  # 32768 keys
    assert call(1, 1500) == ("long", 13)  # 24000 keys: nearer 32768 in log2
    assert call(64, 64 * 300) == ("short", 13)
    assert fn.pick(1, 2048) == 1 and (1, 2048) in fn._memo


def test_cache_decode_slot_compiles_the_table_variants(monkeypatch):
    """The cache's decode slot: one compiled function where the table has one schedule for the
    config (or none), a DecodeByShape over each schedule's function (built once) where it has
    several; the CPU keeps paged_decode's own choice."""
    from tir_kernels import schedules

    from tvmattn.runtime import kernels

    a = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=128)
    b = TensorCoreDecodeSchedule(stages=4, target_blocks=132, min_split_keys=512, l2_prefetch=256)
    built = []

    def fake_build(generator, config, extra):
        built.append(extra)
        return ("compiled", extra)

    monkeypatch.setattr(kernels, "_build", fake_build)
    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    try:
        kernels.decode_kernel.cache_clear()
        two = _table([(1, 4096, a), (1, 32768, b), (64, 4096, a)])
        monkeypatch.setattr(schedules, "load_decode_table", lambda path=None: two)
        tag, fn = kernels.build_slot("decode_paged", config, 2)
        assert tag == "tirx" and isinstance(fn, kernels.DecodeByShape)
        assert fn.variants == [("compiled", (a, None)), ("compiled", (b, None))] and built == [(a, None), (b, None)]
        assert fn.variants[fn.pick(1, 2048)] == ("compiled", (b, None))
        assert kernels.build_slot("decode_paged", config, 2)[1] is fn  # built once per config
        kernels.decode_kernel.cache_clear()
        monkeypatch.setattr(schedules, "load_decode_table", lambda path=None: _table([(1, 4096, a), (64, 4096, a)]))
        assert kernels.build_slot("decode_paged", config, 2) == ["tirx", ("compiled", (a, None))]
        assert kernels.build_slot("decode_paged", config.replace(target="llvm"), 2) == ["tirx", ("compiled", ())]
    finally:
        kernels.decode_kernel.cache_clear()

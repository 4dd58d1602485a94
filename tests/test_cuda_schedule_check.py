"""scripts/cuda_schedule_check.py: CUDA launch extents read from scheduled PrimFuncs, and the
serial CPU run of a CUDA schedule's index math with bound asserts (it must catch an access one
past a buffer's end that a thread-bound schedule makes, and pass the same schedule without it)."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import cuda_schedule_check as csc  # noqa: E402

# a row reduction scheduled as dlight does on CUDA: one block per row, the columns split over 128
# threads (a partial sum per thread in a local buffer, then a shared total); READ is the column
# the update block reads
KERNEL = '''
@T.prim_func(s_tir=True)
def row_sum(x: T.Buffer((1, "batch_size", 640), "float16"), y: T.Buffer((1, "batch_size"), "float32")):
    batch_size = T.int32()
    partial = T.sblock_alloc_buffer((128, batch_size), scope="local")
    total = T.sblock_alloc_buffer((batch_size,), scope="shared")
    for b in T.thread_binding(batch_size, thread="blockIdx.x"):
        for t in T.thread_binding(128, thread="threadIdx.x"):
            with T.sblock("init"):
                vt, vb = T.axis.remap("SS", [t, b])
                partial[vt, vb] = T.float32(0.0)
            for k in range(5):
                with T.sblock("update"):
                    vt, vb, vk = T.axis.remap("SSR", [t, b, k])
                    partial[vt, vb] = partial[vt, vb] + T.Cast("float32", x[0, vb, READ])
        for t in T.thread_binding(128, thread="threadIdx.x"):
            with T.sblock("total"):
                vt, vb = T.axis.remap("RS", [t, b])
                with T.init():
                    total[vb] = T.float32(0.0)
                total[vb] = total[vb] + partial[vt, vb]
        for t in T.thread_binding(1, thread="threadIdx.x"):
            with T.sblock("out"):
                vb = T.axis.spatial(batch_size, b)
                y[0, vb] = total[vb]
'''


def kernel(read: str):
    import tvm

    parsed = tvm.script.from_source(KERNEL.replace("READ", read))
    return parsed[parsed.get_global_vars()[0]] if isinstance(parsed, tvm.IRModule) else parsed


@pytest.mark.parametrize("batch", [1, 16])
def test_serial_run_passes_a_schedule_that_stays_inside_its_buffers(batch):
    assert csc.check_kernel(kernel("vk * 128 + vt"), batch).startswith("ok (")


@pytest.mark.parametrize("batch", [1, 16])
def test_serial_run_catches_a_read_one_past_the_row(batch):
    """Column k * 128 + t + 1: the last thread of the last step reads column 640 of 640."""
    with pytest.raises(Exception, match="out of bounds"):
        csc.check_kernel(kernel("vk * 128 + vt + 1"), batch)


def test_loads_inside_if_then_else_are_guarded_not_checked():
    script, added = csc.with_bound_asserts(
        "def f(a: T.Buffer((T.int64(4),), \"float32\"), o: T.Buffer((T.int64(4),), \"float32\")):\n"
        "    o[i] = T.if_then_else(i < T.int64(3), a[i + T.int64(1)], T.float32(0.0))\n")
    assert added == 1
    check = script.splitlines()[1].split(', "out of bounds')[0]
    assert "T.Cast('int64', i) < T.Cast('int64', T.int64(4))" in check and "i + T.int64(1)" not in check


def test_hand_written_kernels_are_skipped():
    assert "hand-written" in csc.serial_problem("T.ptx.cp(...)")
    assert csc.serial_problem("for i in T.serial(4):") is None


SPLIT_KV = '''
    for b in T.thread_binding(batch, thread="blockIdx.x"):
        for hkv in T.thread_binding(1, thread="blockIdx.y"):
            for split in T.thread_binding(T.min(T.max(132 // batch, 1), 64), thread="blockIdx.z"):
                for tid in T.thread_binding(128, thread="threadIdx.x"):
                    pass
    for b in T.thread_binding(batch, thread="blockIdx.x"):
        for h in T.thread_binding(4, thread="blockIdx.y"):
            for e in T.thread_binding(256, thread="threadIdx.x"):
                pass
'''


@pytest.mark.parametrize("batch, splits", [(1, 64), (16, 8), (64, 2), (4096, 1)])
def test_launch_extents_of_two_kernels_evaluated_per_batch(batch, splits):
    first, second = csc.launches(SPLIT_KV)
    assert first == {"blockIdx.x": "batch", "blockIdx.y": "1", "blockIdx.z": "T.min(T.max(132 // batch, 1), 64)",
                     "threadIdx.x": "128"}
    assert csc.evaluate(first["blockIdx.z"], batch) == splits
    assert [csc.evaluate(second[k], batch) for k in ("blockIdx.x", "blockIdx.y", "threadIdx.x")] == [batch, 4, 256]


@pytest.mark.slow
def test_tiny_sliding_model_batch_decode_kernels_pass_the_serial_check():
    with open(os.path.join(ROOT, "scripts", "sliding-window-tiny-config.json")) as f:
        mod = csc.lowered_module(json.load(f), "tvmattn", max_batch=8)
    names = csc.launched(mod, "batch_decode")
    assert "[cache] tvmattn.attention_kv_cache_attention_with_fused_qkv" in names
    results = {name: csc.check_kernel(mod[name], 3) for name in dict.fromkeys(names) if not name.startswith("[")}
    assert results and all(r.startswith(("ok", "skipped")) for r in results.values()), results
    assert any(r.startswith("ok") for r in results.values())

"""Benchmark tvmattn's paged decode and prefill beside TVM's own TIR kernels and torch SDPA.

All kernels run in one process on the same inputs; their outputs are checked to agree before
timing. Decode reports GB/s of K/V + q + o moved; causal prefill reports TFLOP/s
(2 * B * Hq * L^2 * D: QK^T and PV, half of the square). Needs a CUDA GPU and torch.

    python scripts/bench_kernels.py                 # the issue's shapes
    python scripts/bench_kernels.py --decode 1x4096 --prefill 1x4096
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import tvm  # noqa: E402

from tir_kernels import AttentionConfig, build, paged_decode  # noqa: E402

NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 32, 8, 128, 16, "float16"
DECODE_SHAPES = ["1x4096", "1x32768", "8x32768", "64x4096", "256x2048"]
PREFILL_SHAPES = ["1x4096", "4x4096"]
L2_BYTES = 60 << 20


def parse_shapes(items):
    return [tuple(int(x) for x in item.split("x")) for item in items]


def to_tvm(t: torch.Tensor):
    return tvm.runtime.from_dlpack(t)


def time_us(fn, iters: int) -> float:
    """Median over 5 repeats of the mean time per call, CUDA events."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / iters)
    return float(np.median(samples))


class PagedInputs:
    """`copies` independent page pools of B requests x L tokens (shuffled page ids), so that
    repeated calls do not just hit L2; plus contiguous K/V of copy 0 for SDPA."""

    def __init__(self, batch: int, length: int, copies: int, gen: torch.Generator):
        pages_per_req = math.ceil(length / PAGE_SIZE)
        self.num_pages = batch * pages_per_req
        shape = (self.num_pages, 2, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM)
        self.pools = [torch.randn(shape, generator=gen, device="cuda").half() for _ in range(copies)]
        perm = torch.randperm(self.num_pages, generator=gen, device="cuda").int()
        self.page_indices = perm
        self.page_indptr = torch.arange(0, self.num_pages + 1, pages_per_req, device="cuda", dtype=torch.int32)
        self.last_page_len = torch.full((batch,), length - (pages_per_req - 1) * PAGE_SIZE, device="cuda", dtype=torch.int32)
        # Contiguous [B, Hkv, L, D] K and V of pool 0, for SDPA.
        table = perm.long().view(batch, pages_per_req)
        kv = self.pools[0][table]  # [B, pages, 2, Hkv, ps, D]
        kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(batch, 2, NUM_KV_HEADS, pages_per_req * PAGE_SIZE, HEAD_DIM)
        self.k = kv[:, 0, :, :length].contiguous()
        self.v = kv[:, 1, :, :length].contiguous()
        self.tvm_pools = [to_tvm(p) for p in self.pools]
        self.zeros = torch.zeros(batch, device="cuda", dtype=torch.int32)
        self.bytes_per_pool = self.pools[0].numel() * 2


def copies_for(nbytes: int) -> int:
    return max(1, min(16, math.ceil(4 * L2_BYTES / nbytes)))


def tvm_anchor_decode(target):
    from tvm.relax.frontend.nn.llm import _decode_kernels

    return _decode_kernels._attention_decode(NUM_KV_HEADS, NUM_QO_HEADS, HEAD_DIM, DTYPE, False, {}, target, PAGE_SIZE)


def tvm_anchor_prefill(target):
    from tvm.relax.frontend.nn.llm import _prefill_kernels

    return _prefill_kernels._attention_prefill(NUM_KV_HEADS, NUM_QO_HEADS, HEAD_DIM, DTYPE, False, {}, target, PAGE_SIZE)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_decode(shapes, kernels, iters):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    sm_scale = 1 / math.sqrt(HEAD_DIM)
    for batch, length in shapes:
        pool_bytes = batch * math.ceil(length / PAGE_SIZE) * PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 * 2
        inputs = PagedInputs(batch, length, copies_for(pool_bytes), gen)
        q = torch.randn(batch, NUM_QO_HEADS, HEAD_DIM, generator=gen, device="cuda").half()
        outs = {}
        times = {}
        for name, fn in kernels.items():
            o = torch.empty_like(q)
            lse = torch.empty(batch, NUM_QO_HEADS, device="cuda", dtype=torch.float32)
            args = [to_tvm(q), None, to_tvm(inputs.page_indptr), to_tvm(inputs.page_indices), to_tvm(inputs.last_page_len),
                    to_tvm(inputs.zeros), to_tvm(inputs.zeros), to_tvm(o), to_tvm(lse), 0, 1.0, 1e4, sm_scale]

            def call(i, fn=fn, args=args):
                args[1] = inputs.tvm_pools[i % len(inputs.tvm_pools)]
                fn(*args)

            call(0)
            torch.cuda.synchronize()
            outs[name] = o.clone()
            times[name] = time_us(call, iters)
        qs = q.view(batch, NUM_QO_HEADS, 1, HEAD_DIM)
        sdpa = lambda i: torch.nn.functional.scaled_dot_product_attention(qs, inputs.k, inputs.v, enable_gqa=True)  # noqa: E731
        outs["sdpa"] = sdpa(0).view(batch, NUM_QO_HEADS, HEAD_DIM)
        times["sdpa"] = time_us(sdpa, iters)
        moved = batch * length * NUM_KV_HEADS * HEAD_DIM * 2 * 2 + 2 * q.numel() * 2
        diffs = {name: max_diff(outs[name], outs["sdpa"]) for name in outs}
        rows.append((f"{batch}x{length}", times, {n: moved / t / 1e3 for n, t in times.items()}, diffs))
        del inputs
        torch.cuda.empty_cache()
    return rows


def bench_prefill(shapes, kernels, iters):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    sm_scale = 1 / math.sqrt(HEAD_DIM)
    for batch, length in shapes:
        inputs = PagedInputs(batch, length, 1, gen)
        q = torch.randn(batch * length, NUM_QO_HEADS, HEAD_DIM, generator=gen, device="cuda").half()
        qo_indptr = torch.arange(0, batch * length + 1, length, device="cuda", dtype=torch.int32)
        q_pos = torch.zeros(batch * length, device="cuda", dtype=torch.int32)
        outs, times = {}, {}
        for name, fn in kernels.items():
            o = torch.empty_like(q)
            lse = torch.empty(batch * length, NUM_QO_HEADS, device="cuda", dtype=torch.float32)
            args = [to_tvm(q), to_tvm(qo_indptr), inputs.tvm_pools[0], to_tvm(inputs.page_indptr), to_tvm(inputs.page_indices),
                    to_tvm(inputs.last_page_len), to_tvm(inputs.zeros), to_tvm(q_pos), to_tvm(o), to_tvm(lse), 1, 0, 1.0, 1e4, sm_scale]
            call = lambda i, fn=fn, args=args: fn(*args)  # noqa: E731
            call(0)
            torch.cuda.synchronize()
            outs[name] = o.clone()
            times[name] = time_us(call, iters)
        qs = q.view(batch, length, NUM_QO_HEADS, HEAD_DIM).transpose(1, 2)
        sdpa = lambda i: torch.nn.functional.scaled_dot_product_attention(qs, inputs.k, inputs.v, is_causal=True, enable_gqa=True)  # noqa: E731
        outs["sdpa"] = sdpa(0).transpose(1, 2).reshape(batch * length, NUM_QO_HEADS, HEAD_DIM)
        times["sdpa"] = time_us(sdpa, iters)
        flops = 2 * batch * NUM_QO_HEADS * length * length * HEAD_DIM
        diffs = {name: max_diff(outs[name], outs["sdpa"]) for name in outs}
        rows.append((f"{batch}x{length}", times, {n: flops / t / 1e6 for n, t in times.items()}, diffs))
    return rows


def print_table(title, unit, rows):
    names = list(rows[0][1])
    print(f"\n{title}")
    header = f"{'BxL':>10} | " + " | ".join(f"{n + ' us':>12} {unit:>8}" for n in names)
    header += " | " + " | ".join(f"{'speedup vs ' + n:>14}" for n in names if n != "tvmattn") + " | max|diff| vs sdpa"
    print(header)
    for shape, times, rates, diffs in rows:
        line = f"{shape:>10} | " + " | ".join(f"{times[n]:>12.1f} {rates[n]:>8.1f}" for n in names)
        line += " | " + " | ".join(f"{times[n] / times['tvmattn']:>14.2f}" for n in names if n != "tvmattn")
        line += " | " + " ".join(f"{n}={diffs[n]:.2e}" for n in names if n != "sdpa")
        print(line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", nargs="*", default=DECODE_SHAPES, help="BxL shapes for decode")
    parser.add_argument("--prefill", nargs="*", default=PREFILL_SHAPES, help="BxL shapes for causal prefill")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--arch", default=None, help="CUDA arch (default: the present GPU's)")
    args = parser.parse_args(argv)

    from tir_kernels.support import resolve_target

    config = AttentionConfig(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, page_size=PAGE_SIZE,
                             target=resolve_target("cuda", args.arch))
    target = config.tvm_target()
    t0 = time.time()
    if args.decode:
        decode_kernels = {"tvmattn": build(paged_decode(config), config), "tvm": build(tvm_anchor_decode(target), config)}
        print(f"decode kernels built in {time.time() - t0:.1f} s")
        print_table("paged decode, 32 q / 8 kv heads, d128, fp16, page 16 (GB/s)", "GB/s", bench_decode(parse_shapes(args.decode), decode_kernels, args.iters))
    if args.prefill:
        from tir_kernels import paged_prefill

        t0 = time.time()
        prefill_kernels = {"tvmattn": build(paged_prefill(config), config), "tvm": build(tvm_anchor_prefill(target), config)}
        print(f"prefill kernels built in {time.time() - t0:.1f} s")
        print_table("causal paged prefill, 32 q / 8 kv heads, d128, fp16, page 16 (TFLOP/s)", "TFLOP/s", bench_prefill(parse_shapes(args.prefill), prefill_kernels, max(3, args.iters // 4)))


if __name__ == "__main__":
    main()

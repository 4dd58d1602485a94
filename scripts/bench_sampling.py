"""The library's `sample` kernel (tir_kernels/sampling.py) beside torch, per sampling mode.

Rows of float32 logits (--rows, default 1 16 64) over a vocabulary (--vocab, default SmolLM2's
49,152 and Llama-3's 128,256), one token per row in each mode:
- greedy (temperature 0);
- temperature 1.0;
- top-k 50 at temperature 0.8;
- top-p 0.9 at temperature 0.8.

Ours: `sample_tokens` compiled for the GPU, params (u, temperature, top_k, top_p) per row.
The anchor, torch, is what a Python server does:
- greedy: argmax;
- the others: softmax of logits / temperature, the top-k / top-p cut by a sort, then
  torch.multinomial.

Device time per call comes from the kernels alone (torch.profiler, mean over --iters calls),
so host launch cost is left out. Every token is checked:
- greedy rows must equal numpy's argmax;
- a sampled row must draw inside its mode's kept set (the top-k ids; the top-p prefix of the
  sorted probabilities, with its boundary token).

    python scripts/bench_sampling.py [--vocab 49152 128256] [--rows 1 16 64] [--iters 50] [--json rows.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

# name -> (temperature, top_k, top_p)
MODES = {"greedy": (0.0, 0, 1.0), "temperature": (1.0, 0, 1.0), "top-k": (0.8, 50, 1.0), "top-p": (0.8, 0, 0.9)}
VOCABS = (49152, 128256)
ROWS = (1, 16, 64)


def build(target: str):
    """The compiled `sample` function for target ("cuda" or "llvm")."""
    import tvm

    from tir_kernels.sampling import SamplingConfig, sample_tokens

    config = SamplingConfig("float32", target)
    return tvm.compile(tvm.IRModule({"main": sample_tokens(config)}), target=config.tvm_target())["main"]


def params_for(mode: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    """params [rows, 4] float32 of `sample`: (u, temperature, top_k, top_p)."""
    temperature, top_k, top_p = MODES[mode]
    u = np.minimum(rng.random(rows), np.nextafter(1.0, 0.0)).astype(np.float32)
    return np.stack([u, np.full(rows, temperature), np.full(rows, top_k), np.full(rows, top_p)], 1).astype(np.float32)


def kept_sets(logits: np.ndarray, mode: str) -> list[set[int]]:
    """Per row, the ids a draw of `mode` may return (greedy: the argmax alone)."""
    temperature, top_k, top_p = MODES[mode]
    out = []
    for z in logits.astype(np.float64):
        if temperature <= 0:
            out.append({int(np.argmax(z))})
            continue
        order = np.argsort(-z, kind="stable")
        keep = len(z) if top_k <= 0 else top_k
        if top_p < 1:
            w = np.exp((z[order[:keep]] - z[order[0]]) / temperature)
            cdf = np.cumsum(w) / w.sum()
            keep = min(keep, int(np.searchsorted(cdf, top_p * (1 - 1e-6))) + 2)  # the boundary token and one beyond
        out.append(set(order[:keep].tolist()))
    return out


def torch_sampler(mode: str):
    """The anchor: tokens [rows] of logits [rows, vocab] (a CUDA tensor) in `mode`."""
    import torch

    temperature, top_k, top_p = MODES[mode]

    def sample(logits):
        if temperature <= 0:
            return logits.argmax(-1)
        z = logits / temperature
        if top_k > 0:
            values, ids = z.topk(top_k, dim=-1)
            choice = torch.multinomial(torch.softmax(values, -1), 1)
            return ids.gather(-1, choice)[:, 0]
        if top_p < 1:
            values, ids = z.sort(dim=-1, descending=True)
            probs = torch.softmax(values, -1)
            cut = probs.cumsum(-1) - probs > top_p
            probs = probs.masked_fill(cut, 0)
            return ids.gather(-1, torch.multinomial(probs, 1))[:, 0]
        return torch.multinomial(torch.softmax(z, -1), 1)[:, 0]

    return sample


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", nargs="+", type=int, default=list(VOCABS))
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", metavar="PATH", help="also write the results as rows (docs/bench-format.md)")
    args = p.parse_args(argv)
    sample = build("cuda")

    import torch
    import tvm
    from bench_small_batch import device_us

    import bench_rows

    meta = bench_rows.run_meta(gpu=True) if args.json else {}
    rng = np.random.default_rng(0)
    rows_out, failures = [], []
    print(f"{'vocab':>7} {'rows':>5} " + " ".join(f"{m + ' ours/torch':>22}" for m in args.modes) + "   (us per call)")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = (2 * rng.standard_normal((rows, vocab))).astype(np.float32)
            on_gpu = torch.from_numpy(logits).cuda()
            tvm_logits = tvm.runtime.from_dlpack(on_gpu)
            tokens = torch.empty(rows, dtype=torch.int32, device="cuda")
            tvm_tokens = tvm.runtime.from_dlpack(tokens)
            cells = []
            for mode in args.modes:
                params = tvm.runtime.from_dlpack(torch.from_numpy(params_for(mode, rows, rng)).cuda())
                ours = device_us(lambda: sample(tvm_logits, params, tvm_tokens), args.iters)
                anchor = torch_sampler(mode)
                theirs = device_us(lambda: anchor(on_gpu), args.iters)
                sample(tvm_logits, params, tvm_tokens)
                allowed = kept_sets(logits, mode)
                ok = all(int(t) in s for t, s in zip(tokens.cpu().numpy(), allowed))
                torch_ok = all(int(t) in s for t, s in zip(anchor(on_gpu).cpu().numpy(), allowed))
                failures += [f"{mode} vocab {vocab} rows {rows} {who}" for who, good in (("ours", ok), ("torch", torch_ok))
                             if not good]
                for impl, us, good in (("tvmattn", ours, ok), ("torch", theirs, torch_ok)):
                    rows_out.append({"bench": "kernels", "kernel": "sample", "impl": impl, "variant": f"{mode} vocab {vocab}",
                                     "dtype": "float32", "batch": rows, "vocab": vocab, "ms": us / 1e3, "agrees": good,
                                     **meta})
                cells.append(f"{ours:>10.2f} /{theirs:>9.2f}")
            print(f"{vocab:>7} {rows:>5} " + " ".join(f"{c:>22}" for c in cells))
    return bench_rows.finish(rows_out, args.json, failures, "FAILED (a token outside its kept set): ")


if __name__ == "__main__":
    sys.exit(main())

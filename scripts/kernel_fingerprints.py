"""Fingerprints of the generated kernels: the sha256 of the TVMScript of a sample of configurations.

Builds the PrimFunc of a representative sample of configurations of every generator in
`tir_kernels` (decode on CUDA cores and tensor cores with their RoPE, sliding-window and merge
variants; prefill on CUDA cores, sm_80 mma, sm_90 wgmma, paged, ragged and token-tree; MLA decode
and prefill on every kernel; merge, rotary and page operations) for the CPU (`llvm`) and CUDA
sm_80 / sm_86 / sm_90 targets. No GPU is needed: the generators only produce TIR. Each
PrimFunc's `script()` (TVMScript) is hashed, so a restructuring of the generators can be checked
to leave every kernel byte-identical:

    python scripts/kernel_fingerprints.py --out /tmp/fp_before.json           # before
    python scripts/kernel_fingerprints.py --out /tmp/fp_after.json --compare /tmp/fp_before.json

--only SUBSTRING keeps the cases whose name contains it (repeatable); --list prints the names.
The exit status is 1 when --compare finds a changed or missing fingerprint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tir_kernels import AttentionConfig, MLAConfig, RopeScaling  # noqa: E402

LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _config_name(config) -> str:
    """A short, stable name of a config (its non-default fields)."""
    defaults = type(config).__dataclass_fields__
    parts = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        default = defaults[field.name].default
        if field.name in ("num_qo_heads", "num_kv_heads", "head_dim", "num_heads") or value != default:
            if isinstance(value, RopeScaling):
                value = "llama3"
            parts.append(f"{field.name}={value}")
    return ",".join(parts)


def _decode_cases():
    import tir_kernels as tk
    from tir_kernels import schedules

    from_tc = _module_attr(("decode_tc",), "paged_decode_tc")
    cases = []
    # CPU: the row-tile path (head dims of whole vectors), the generic path, sliding, fp32, RoPE scaling
    for cfg in (AttentionConfig(32, 8, 128, dtype="float16"), AttentionConfig(9, 3, 64, dtype="float32"),
                AttentionConfig(8, 8, 80, dtype="bfloat16", page_size=1),
                AttentionConfig(16, 4, 128, dtype="float32", sliding_window=True, rope_scaling=LLAMA3)):
        cases.append((f"decode/{_config_name(cfg)}", lambda c=cfg: tk.paged_decode(c)))
    cases.append(("decode/cpu-schedule-rpt4", lambda: tk.paged_decode(
        AttentionConfig(16, 4, 64, dtype="float32"), tk.DecodeSchedule(lanes=1, rows=1, rows_per_thread=4,
                                                                        heads_per_block=4, max_splits=8))))
    # CUDA: the dispatch (table / default; CUDA-core for small groups, fp32, old archs)
    for target in ("cuda:sm_80", "cuda:sm_90", "cuda:sm_86", "cuda:sm_75"):
        for cfg in (AttentionConfig(32, 8, 128, dtype="float16", target=target),
                    AttentionConfig(32, 2, 128, dtype="bfloat16", target=target),
                    AttentionConfig(32, 16, 128, dtype="float16", target=target),
                    AttentionConfig(16, 4, 64, dtype="float32", target=target)):
            cases.append((f"decode/{_config_name(cfg)}", lambda c=cfg: tk.paged_decode(c)))
    for cfg in (AttentionConfig(16, 1, 256, dtype="float16", target="cuda:sm_90"),
                AttentionConfig(32, 8, 128, dtype="bfloat16", target="cuda:sm_90", sliding_window=True),
                AttentionConfig(12, 3, 80, dtype="float16", target="cuda:sm_80", page_size=8),
                AttentionConfig(32, 4, 64, dtype="float16", target="cuda:sm_90", rope_scaling=LLAMA3),
                AttentionConfig(8, 8, 128, dtype="float16", target="cuda:sm_90", page_size=1)):
        cases.append((f"decode/{_config_name(cfg)}", lambda c=cfg: tk.paged_decode(c)))
    # CUDA-core with an explicit schedule on a tensor-core config
    cfg = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    cases.append(("decode/cuda-core-schedule/" + _config_name(cfg),
                  lambda c=cfg: tk.paged_decode(c, schedules.choose_decode_schedule(c))))
    # tensor-core schedules: every candidate (fused / cooperative / fan-in merges, PDL, L2 hints,
    # copy widths, early pages, heads first), and the inline-RoPE candidates
    for cfg in (AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90"),
                AttentionConfig(32, 4, 128, dtype="bfloat16", target="cuda:sm_90", sliding_window=True)):
        for i, (label, sched) in enumerate(schedules.tc_decode_candidates(cfg).items()):
            if cfg.sliding_window and i % 3:
                continue  # the sliding build: a third of them
            cases.append((f"decode_tc/{_config_name(cfg)}/{label}", lambda c=cfg, s=sched: from_tc()(c, s)))
    cfg = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    base = schedules.choose_tc_decode_schedule(cfg)
    for i, (label, rope) in enumerate(schedules.tc_decode_rope_candidates(cfg).items()):
        if i % 3:
            continue  # a third of them: each shape of the rope build, in less time
        plain = dataclasses.replace(base, dependent_launch=rope.dependent_launch,
                                    early_pages=rope.early_pages or base.early_pages)
        cases.append((f"decode_tc/rope/{_config_name(cfg)}/{label}", lambda c=cfg, s=plain, r=rope: from_tc()(c, s, r)))
    for cfg in (AttentionConfig(16, 1, 256, dtype="bfloat16", target="cuda:sm_80"),
                AttentionConfig(8, 2, 64, dtype="float16", target="cuda:sm_86", page_size=64),
                AttentionConfig(32, 4, 96, dtype="float16", target="cuda:sm_90")):
        cases.append((f"decode_tc/{_config_name(cfg)}", lambda c=cfg: from_tc()(c)))
    return cases


def _module_attr(modules: tuple, name: str):
    """A getter of `name` from the first of tir_kernels' `modules` that defines it (generators
    found where they live, before and after a move)."""
    import importlib

    def get():
        for module in modules:
            try:
                mod = importlib.import_module(f"tir_kernels.{module}")
            except ImportError:
                continue
            if hasattr(mod, name):
                return getattr(mod, name)
        raise AttributeError(f"none of {modules} defines {name}")

    return get


def _prefill_cases():
    import tir_kernels as tk
    from tir_kernels.schedules import PrefillSchedule, WgmmaPrefillSchedule

    mma_schedule = _module_attr(("prefill_sm80",), "MmaPrefillSchedule")
    paged_mma = _module_attr(("prefill_sm80",), "paged_prefill_mma")
    ragged_mma = _module_attr(("prefill_sm80",), "ragged_prefill_mma")
    cases = []
    gens = {"paged": tk.paged_prefill, "ragged": tk.ragged_prefill, "tree_paged": tk.tree_mask_paged_prefill,
            "tree_ragged": tk.tree_mask_ragged_prefill}
    configs = [
        AttentionConfig(32, 8, 128, dtype="float16"),
        AttentionConfig(8, 8, 64, dtype="float32", page_size=1),
        AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_80"),
        AttentionConfig(16, 2, 256, dtype="bfloat16", target="cuda:sm_80", page_size=64),
        AttentionConfig(16, 4, 64, dtype="float16", target="cuda:sm_80"),
        AttentionConfig(12, 3, 80, dtype="bfloat16", target="cuda:sm_86"),
        AttentionConfig(16, 2, 256, dtype="float16", target="cuda:sm_86"),
        AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90"),
        AttentionConfig(16, 16, 64, dtype="bfloat16", target="cuda:sm_90", page_size=128),
        AttentionConfig(12, 3, 80, dtype="float16", target="cuda:sm_90"),
        AttentionConfig(16, 4, 128, dtype="float32", target="cuda:sm_90"),
        AttentionConfig(16, 4, 128, dtype="float16", target="cuda:sm_75"),
    ]
    for cfg in configs:
        for kind, gen in gens.items():
            cases.append((f"prefill/{kind}/{_config_name(cfg)}", lambda c=cfg, g=gen: g(c)))
    for cfg in (AttentionConfig(32, 8, 128, dtype="float16", sliding_window=True, rope_scaling=LLAMA3),
                AttentionConfig(32, 8, 128, dtype="bfloat16", target="cuda:sm_80", sliding_window=True),
                AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90", sliding_window=True,
                                rope_scaling=LLAMA3)):
        cases.append((f"prefill/paged/{_config_name(cfg)}", lambda c=cfg: tk.paged_prefill(c)))
    # ragged with v_head_dim != head_dim (MLA-style prefill of new tokens)
    for cfg in (AttentionConfig(16, 16, 192, v_head_dim=128, dtype="float16"),
                AttentionConfig(16, 16, 192, v_head_dim=128, dtype="bfloat16", target="cuda:sm_80"),
                AttentionConfig(16, 16, 192, v_head_dim=128, dtype="float16", target="cuda:sm_90")):
        cases.append((f"prefill/ragged/{_config_name(cfg)}", lambda c=cfg: tk.ragged_prefill(c)))
    # explicit schedules: CUDA-core on a tensor-core config, mma variants, wgmma variants
    cfg = AttentionConfig(32, 8, 128, dtype="float16", target="cuda:sm_90")
    core = PrefillSchedule(threads_y=16, threads_x=8, rows_per_thread=4, cols_per_thread=4)
    cases.append(("prefill/paged/cuda-core-schedule", lambda: tk.paged_prefill(cfg, core)))
    cases.append(("prefill/tree_ragged/cuda-core-schedule", lambda: tk.tree_mask_ragged_prefill(cfg, core)))
    for i, kw in enumerate((dict(warps=4, rows_per_warp=32, tile_kv=32, stages=1, q_in_registers=False),
                            dict(warps=2, rows_per_warp=16, tile_kv=64, stages=2, q_in_registers=True),
                            dict(warps=8, rows_per_warp=16, tile_kv=16, stages=1, q_in_registers=True))):
        cases.append((f"prefill/paged_mma/{i}", lambda k=kw: paged_mma()(cfg, mma_schedule()(**k))))
        cases.append((f"prefill/ragged_mma/{i}", lambda k=kw: ragged_mma()(cfg, mma_schedule()(**k))))
        cases.append((f"prefill/tree_paged/mma-schedule-{i}",
                      lambda k=kw: tk.tree_mask_paged_prefill(cfg, mma_schedule()(**k))))
    for i, sched in enumerate((WgmmaPrefillSchedule(tile_kv=64, stages=2, pingpong=False),
                               WgmmaPrefillSchedule(tile_kv=128, stages=2, producer_regs=24, consumer_regs=240))):
        cases.append((f"prefill/paged/wgmma-schedule-{i}", lambda s=sched: tk.paged_prefill(cfg, s)))
        cases.append((f"prefill/tree_ragged/wgmma-schedule-{i}", lambda s=sched: tk.tree_mask_ragged_prefill(cfg, s)))
    return cases


def _mla_cases():
    import tir_kernels as tk

    tc = _module_attr(("mla_tc",), "mla_paged_decode_tc")
    tc_schedule = _module_attr(("mla_tc",), "MLATensorCoreSchedule")
    auto = _module_attr(("mla", "mla_tc"), "mla_paged_decode_auto")
    wgmma_decode = _module_attr(("mla_sm90",), "mla_paged_decode_wgmma")
    wgmma_prefill = _module_attr(("mla_sm90",), "mla_paged_prefill_wgmma")
    wgmma_schedule = _module_attr(("mla_sm90",), "MLAWgmmaSchedule")
    wgmma_split = _module_attr(("mla_sm90",), "MLAWgmmaDecodeSplit")
    cases = []
    configs = [
        MLAConfig(16, 512, 64, dtype="float16"),
        MLAConfig(8, 64, 16, dtype="float32", page_size=1),
        MLAConfig(128, 512, 64, dtype="float16", target="cuda:sm_90"),
        MLAConfig(16, 512, 64, dtype="bfloat16", target="cuda:sm_90", page_size=64),
        MLAConfig(16, 512, 64, dtype="float16", target="cuda:sm_80"),
        MLAConfig(40, 256, 32, dtype="bfloat16", target="cuda:sm_86"),
        MLAConfig(16, 160, 0, dtype="float16", target="cuda:sm_90"),
        MLAConfig(16, 512, 64, dtype="float32", target="cuda:sm_90"),
    ]
    for cfg in configs:
        name = _config_name(cfg)
        cases.append((f"mla/decode/{name}", lambda c=cfg: tk.mla_paged_decode(c)))
        cases.append((f"mla/prefill/{name}", lambda c=cfg: tk.mla_paged_prefill(c)))
        cases.append((f"mla/decode_auto/{name}", lambda c=cfg: auto()(c)))
        for gen in ("mla_transpose_append", "mla_copy_single_page"):
            cases.append((f"mla/{gen}/{name}", lambda c=cfg, g=gen: getattr(tk, g)(c)))
        cases.append((f"mla/mla_debug_get_kv/{name}", lambda c=cfg: tk.mla_debug_get_kv(c, 3)))
        cases.append((f"mla/merge_state/{name}", lambda c=cfg: tk.merge_state(c)))
    cfg = MLAConfig(128, 512, 64, dtype="float16", target="cuda:sm_90")
    for i, kw in enumerate((dict(m_tiles=2, col_slices=4, stages=2), dict(m_tiles=1, col_slices=1, stages=2,
                                                                          max_splits=1))):
        cases.append((f"mla_tc/{i}", lambda k=kw: tc()(cfg, tc_schedule()(**k))))
    for i, kw in enumerate((dict(tile_kv=64, stages=2, split_keys=True), dict(tile_kv=32, stages=4, pingpong=False),
                            dict(tile_kv=16, stages=2))):
        cases.append((f"mla_sm90/prefill/{i}", lambda k=kw: wgmma_prefill()(cfg, wgmma_schedule()(**k))))
        cases.append((f"mla_sm90/decode/{i}", lambda k=kw: wgmma_decode()(cfg, wgmma_schedule()(**k))))
    for i, kw in enumerate((dict(max_splits=1), dict(max_splits=8, min_split_keys=256, target_ctas=64))):
        cases.append((f"mla_sm90/decode-split/{i}", lambda k=kw: wgmma_decode()(cfg, None, wgmma_split()(**k))))
    cfg16 = MLAConfig(16, 512, 64, dtype="bfloat16", target="cuda:sm_90")
    cases.append(("mla_sm90/decode/16-heads", lambda: wgmma_decode()(cfg16)))
    cases.append(("mla_tc/16-heads-sm90", lambda: tc()(cfg16)))
    from tir_kernels import MLASchedule

    cpu = MLAConfig(16, 512, 64, dtype="float16")
    cases.append(("mla/decode/cpu-schedule", lambda: tk.mla_paged_decode(
        cpu, MLASchedule(threads_y=1, threads_x=1, rows_per_thread=8, cols_per_thread=16))))
    cases.append(("mla/prefill/simt-schedule-on-sm90", lambda: tk.mla_paged_prefill(
        cfg, MLASchedule(threads_y=16, threads_x=16, rows_per_thread=1, cols_per_thread=2))))
    return cases


def _elementwise_cases():
    import tir_kernels as tk

    cases = []
    configs = [
        AttentionConfig(32, 8, 128, dtype="float16"),
        AttentionConfig(9, 3, 64, dtype="float32", page_size=1, rope_scaling=LLAMA3),
        AttentionConfig(32, 8, 128, dtype="bfloat16", target="cuda:sm_90"),
        AttentionConfig(16, 2, 80, dtype="float32", target="cuda:sm_80", page_size=64, sliding_window=True),
    ]
    for cfg in configs:
        name = _config_name(cfg)
        for gen in ("merge_state", "split_rotary", "split_rotary_append", "transpose_append", "copy_single_page",
                    "compact_copy"):
            cases.append((f"{gen}/{name}", lambda c=cfg, g=gen: getattr(tk, g)(c)))
        cases.append((f"debug_get_kv/{name}", lambda c=cfg: tk.debug_get_kv(c, 2)))
    return cases


def all_cases():
    """[(name, thunk)]: every sampled configuration of every generator."""
    return _decode_cases() + _prefill_cases() + _mla_cases() + _elementwise_cases()


def fingerprint(func) -> str:
    return hashlib.sha256(func.script().encode()).hexdigest()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write {case: sha256} here (JSON)")
    parser.add_argument("--compare", help="a JSON file of an earlier run: report changed and missing cases")
    parser.add_argument("--only", action="append", default=[], help="keep the cases whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    args = parser.parse_args(argv)
    cases = all_cases()
    names = [name for name, _ in cases]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SystemExit(f"error: duplicate case names: {dup}")
    if args.only:
        cases = [(n, f) for n, f in cases if any(s in n for s in args.only)]
    if args.list:
        print("\n".join(n for n, _ in cases))
        return 0
    result = {}
    start = time.time()
    for i, (name, thunk) in enumerate(cases):
        t0 = time.time()
        try:
            result[name] = fingerprint(thunk())
        except Exception as exc:  # a generator that refuses a config is part of the fingerprint
            result[name] = f"error: {type(exc).__name__}: {exc}"
        print(f"[{i + 1}/{len(cases)}] {time.time() - t0:6.1f}s {name} {result[name][:16]}", flush=True)
    print(f"{len(result)} cases in {time.time() - start:.0f}s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        changed = [n for n in result if n in before and before[n] != result[n]]
        missing = [n for n in before if n not in result and not args.only]
        new = [n for n in result if n not in before]
        same = len(result) - len(changed) - len(new)
        for n in changed:
            print(f"CHANGED {n}: {before[n][:40]} -> {result[n][:40]}")
        for n in missing:
            print(f"MISSING {n}")
        for n in new:
            print(f"NEW {n}")
        print(f"compared {same + len(changed)}: {same} identical, {len(changed)} changed, {len(missing)} missing,"
              f" {len(new)} new")
        return 1 if changed or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

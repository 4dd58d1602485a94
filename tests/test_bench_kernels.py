"""scripts/bench_kernels.py without a GPU: shapes, FLOP counts, rows, tables, --from-json, --plot,
the no-GPU exit, and one tiny run of the benchmark's plumbing on the CPU (kernels built for llvm)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from harness import load_script

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_kernels.py")
HQ, D = 32, 128
META = {"device": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00", "commit": "abc1234"}


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kernels")


# --- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kernel, expected", [
    ("4x4096", "prefill", (4, 4096, 4096)),
    ("8x512@8192", "prefill", (8, 512, 8192)),
    ("1x1@1", "prefill", (1, 1, 1)),
    ("2x16@16", "prefill", (2, 16, 16)),
    ("8x32768", "decode", (8, 1, 32768)),
])
def test_parse_shape(bench, text, kernel, expected):
    shape = bench.parse_shape(text, kernel)
    assert tuple(shape) == expected
    assert (shape.batch, shape.qo_len, shape.seq_len) == expected


def test_shape_labels(bench):
    assert bench.parse_shape("8x512@8192").label == "8x512@8192"
    assert bench.parse_shape("4x4096").label == "4x4096"
    assert bench.parse_shape("2x16@16").label == "2x16"  # Q = L is the plain form
    assert bench.parse_shape("8x32768", "decode").label == "8x32768"


def test_default_shapes_parse(bench):
    assert [bench.parse_shape(s).label for s in bench.PREFILL_SHAPES] == ["1x4096", "4x4096", "1x16384", "8x512@8192"]
    assert all(bench.parse_shape(s, "decode").qo_len == 1 for s in bench.DECODE_SHAPES)


@pytest.mark.parametrize("bad", ["", "4", "4x", "x4096", "4x4096@", "@8192", "0x16", "4x0", "4x-1", "4x4096x2",
                                 "ax4096", "4.0x16", "8x512@0", "8x9000@8192", "8x512@@8192"])
def test_bad_prefill_shape_names_the_argument(bench, capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--prefill", "1x4096", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --prefill" in err and repr(bad) in err


@pytest.mark.parametrize("bad", ["8x512@8192", "8", "1x0"])
def test_bad_decode_shape_names_the_argument(bench, capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--decode", bad])
    assert exit_info.value.code == 2
    assert "argument --decode" in capsys.readouterr().err


def test_q_above_l_says_so(bench):
    with pytest.raises(ValueError, match="Q=9000 exceed the context L=8192"):
        bench.parse_shape("8x9000@8192")


@pytest.mark.parametrize("argv, name", [(["--dtype", "float32"], "--dtype"), (["--head-dim", "96"], "--head-dim"),
                                        (["--page-size", "12"], "--page-size"), (["--iters", "0"], "--iters"),
                                        (["--arch", "90"], "--arch")])
def test_bad_options_name_the_argument(bench, capsys, argv, name):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {name}" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_in_a_missing_folder_is_refused_before_the_run(bench, capsys, tmp_path, option):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([option, str(tmp_path / "nowhere" / "out")])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_help(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("BxQ@L", "--from-json", "--ragged", "--tree", "BxN@L", "--dtype", "--head-dim", "--page-size", "--plot",
                 "--json"):
        assert word in out


# --- token trees ------------------------------------------------------------------------------


def test_tree_option(bench, capsys):
    assert bench.tree_shapes(None) == []  # no --tree: no tree rows
    assert [s.label for s in bench.tree_shapes([])] == ["32x64@4160"]  # the flag alone: 32 trees of 64 over 4096
    args = bench.build_parser().parse_args(["--tree", "4x16@80", "2x8@8"])
    assert [tuple(s) for s in bench.tree_shapes(args.tree)] == [(4, 16, 80), (2, 8, 8)]
    assert bench.build_parser().parse_args([]).tree is None
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--tree", "4x100@80"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tree" in err and "Q=100 exceed the context L=80" in err


@pytest.mark.parametrize("form", ["random", "chain"])
def test_tree_forms(bench, form):
    parents = bench.tree_parents(form, 64, 3)
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert parents == bench.tree_parents(form, 64, 3)  # the seed fixes the tree
    if form == "chain":
        assert parents == list(range(-1, 63))
    else:
        assert parents != bench.tree_parents(form, 64, 4) and parents != list(range(-1, 63))
    with pytest.raises(ValueError, match="bad tree form"):
        bench.tree_parents("bush", 8, 0)


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 1, 2], [-1, 0, 0, 0], [-1, 0, 0, 1, 1, 2, 2], [-1, 0, -1, 2, 3, 0],
                                     "random"])
def test_tree_intervals_match_the_ancestor_walk(bench, parents):
    """The DFS intervals the kernels get and the mask the reference uses say the same thing."""
    parents = bench.tree_parents("random", 40, 7) if parents == "random" else parents
    spans = bench.dfs_intervals(parents)
    visible = bench.tree_visible(parents, 5)
    for q, row in enumerate(visible):
        assert row[:5] == [True] * 5  # the history
        for k in range(len(parents)):
            assert row[5 + k] == (spans[k][0] <= spans[q][0] < spans[k][1]), (q, k)
    assert sorted(b for b, _ in spans) == list(range(len(parents)))


def test_tree_rows_in_tables_and_json(bench, tmp_path, capsys):
    """Tree rows: one line per shape and tree form, tvmattn's rate over its causal prefill's, the
    causal FLOP formula; --from-json reads them back."""
    shape = bench.parse_shape("32x64@4160", "tree_prefill")
    rows = []
    for form in ("random", "chain"):
        meta = {**META, "tree": form, "history": 4096, "flops": "causal"}
        for impl, ms, diff in (("tvmattn", 0.4, 1e-4), ("tvmattn-causal", 0.5, 1e-4), ("tvm", 40.0, 1e-4),
                               ("sdpa", 0.8, None)):
            rows.append(bench.make_row("tree_prefill", impl, "v", "float16", 128, 16, shape, ms, diff, meta))
    assert rows[0]["tflops"] == pytest.approx(bench.causal_flops(32, 64, 4160, 32, 128) / 0.4e-3 / 1e12)
    lines = bench.format_tables(rows).splitlines()
    header = next(line for line in lines if "ours/" in line)
    assert "ours/tvmattn-causal" in header and "ours/tvm" in header
    random_line = next(line for line in lines if "32x64@4160 random" in line)
    assert "32x64@4160 chain" in "\n".join(lines)
    ratios = random_line.split("|")[5].split()  # over tvm, sdpa, tvmattn-causal
    assert ratios == ["100.00", "2.00", "1.25"]
    saved = tmp_path / "tree.json"
    bench.write_json(rows, str(saved))
    assert bench.main(["--from-json", str(saved)]) == 0
    assert "32x64@4160 random" in capsys.readouterr().out


# --- work counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, length", [(1, 1), (1, 4096), (4, 4096), (1, 16384), (3, 17)])
def test_square_causal_flops(bench, batch, length):
    assert bench.causal_flops(batch, length, length, HQ, D) == 4 * batch * HQ * D * length * (length + 1) // 2


@pytest.mark.parametrize("qo_len, seq_len", [(512, 8192), (1, 100), (7, 7), (16, 40), (100, 101)])
def test_chunked_causal_flops(bench, qo_len, seq_len):
    # Query i of qo_len sees keys j <= seq_len - qo_len + i.
    visible = sum(sum(1 for j in range(seq_len) if j <= seq_len - qo_len + i) for i in range(qo_len))
    assert bench.causal_visible_keys(qo_len, seq_len) == visible
    assert bench.causal_flops(8, qo_len, seq_len, HQ, 64) == 4 * 8 * HQ * 64 * visible


def test_flops_of_the_default_chunk(bench):
    # 8 x 512 new tokens over 8192 keys: 7680 cached keys each, then the 512 x 513 / 2 triangle.
    assert bench.causal_flops(8, 512, 8192, 32, 128) == 4 * 8 * 32 * 128 * (512 * 7680 + 512 * 513 // 2)
    assert bench.causal_flops(1, 1, 4096, 32, 128) == 4 * 32 * 128 * 4096  # one query sees every key


@pytest.mark.parametrize("qo_len, seq_len", [(0, 10), (11, 10), (-1, 5)])
def test_flops_refuse_impossible_shapes(bench, qo_len, seq_len):
    with pytest.raises(ValueError):
        bench.causal_flops(1, qo_len, seq_len, HQ, D)


def test_decode_bytes(bench):
    assert bench.decode_bytes(2, 100, 32, 8, 128, 2) == 2 * (2 * 2 * 100 * 8 * 128 + 2 * 2 * 32 * 128)


# --- rows, tables, JSON, plots ----------------------------------------------------------------

FIELDS = ("bench", "kernel", "impl", "variant", "dtype", "head_dim", "num_qo_heads", "num_kv_heads", "page_size",
          "batch", "seq_len", "qo_len", "ms", "device", "date", "commit")


def sample_rows(bench):
    """Rows as a run writes them: prefill (square and chunked) and decode, fp16 and bf16."""
    rows = []
    prefill = [("tvmattn", "wgmma", 1.0, 3e-3), ("tvm", "tir", 4.0, 2e-3), ("sdpa", "is_causal", 2.0, None),
               ("flashinfer-fa3", "paged HND", 0.5, 1e-3)]
    for dtype in ("float16", "bfloat16"):
        for shape in map(bench.parse_shape, ("1x4096", "8x512@8192", "4x4096", "8x8192", "8x1024@8192")):
            for impl, variant, ms, diff in prefill:
                bad = impl == "tvm" and shape.label == "4x4096" and dtype == "float16"
                rows.append(bench.make_row("prefill", impl, variant, dtype, 128, 16, shape, ms, 0.5 if bad else diff,
                                           META))
    for impl, ms, diff in (("tvmattn", 0.05, 1e-3), ("tvm", 0.1, 1e-3), ("sdpa", 0.08, None)):
        for label in ("1x4096", "1x32768"):
            rows.append(bench.make_row("decode", impl, "x", "float16", 128, 16, bench.parse_shape(label, "decode"), ms,
                                       diff, META))
    return rows


def test_row_fields(bench):
    shape = bench.parse_shape("8x512@8192")
    row = bench.make_row("prefill", "tvmattn", "v", "bfloat16", 128, 16, shape, 2.0, 1e-2, META)
    for field in FIELDS:
        assert field in row, field
    assert row["bench"] == "kernels" and row["seq_len"] == 8192 and row["qo_len"] == 512 and row["batch"] == 8
    assert row["tflops"] == pytest.approx(bench.causal_flops(8, 512, 8192, 32, 128) / 2e-3 / 1e12)
    assert row["max_abs_diff"] == 1e-2 and row["agrees"] is True
    assert "gbps" not in row
    decode = bench.make_row("decode", "tvm", "tir", "float16", 128, 16, bench.parse_shape("64x4096", "decode"), 0.5,
                            None, META)
    assert decode["gbps"] == pytest.approx(bench.decode_bytes(64, 4096, 32, 8, 128, 2) / 0.5e-3 / 1e9)
    assert "max_abs_diff" not in decode and "tflops" not in decode and decode["qo_len"] == 1


@pytest.mark.parametrize("diff, dtype, ok", [(1e-2, "float16", True), (3e-2, "float16", False),
                                             (3e-2, "bfloat16", True), (6e-2, "bfloat16", False),
                                             (float("nan"), "float16", False)])
def test_agreement_thresholds(bench, diff, dtype, ok):
    assert bench.agrees(diff, dtype) is ok


def test_table(bench):
    text = bench.format_tables(sample_rows(bench))
    lines = text.splitlines()
    titles = [line for line in lines if line.startswith(("prefill,", "decode,"))]
    assert len(titles) == 3  # prefill fp16, prefill bf16, decode fp16
    assert "TFLOP/s" in titles[0] and "NVIDIA H200" in titles[0] and "abc1234" in titles[0]
    header = next(line for line in lines if "ours/tvm" in line)
    assert header.index("tvmattn") < header.index("tvm ") < header.index("sdpa") < header.index("flashinfer-fa3")
    assert "ours/sdpa" in header and "ours/fi-fa3" in header and "max|diff| vs sdpa" in header
    chunk = next(line for line in lines if line.strip().startswith("8x512@8192"))
    # tvmattn takes 1 ms, TVM 4 ms, SDPA 2 ms, FlashInfer 0.5 ms: ours/X = 4.00, 2.00, 0.50.
    assert chunk.split("|")[5].split() == ["4.00", "2.00", "0.50"]
    assert "tvmattn=3.0e-03" in chunk and "fi-fa3=1.0e-03" in chunk and "MISMATCH" not in chunk
    bad = [line for line in lines if "MISMATCH" in line and not line.startswith("(")]
    assert len(bad) == 1 and bad[0].strip().startswith("4x4096") and "tvm=5.0e-01 MISMATCH" in bad[0]
    assert any("GB/s" in t for t in titles)


def test_table_with_missing_impls(bench):
    shape = bench.parse_shape("1x4096")
    rows = [bench.make_row("prefill", "sdpa", "is_causal", "float16", 64, 16, shape, 2.0, None, META),
            bench.make_row("prefill", "tvm", "tir", "float16", 64, 16, shape, 4.0, 1e-3, META)]
    header, line = bench.format_tables(rows).splitlines()[2:4]
    assert "ours/" not in header and "tvm=1.0e-03" in line  # no tvmattn row: no ratios
    assert header.index("tvm") < header.index("sdpa")


def test_from_json_round_trip(bench, tmp_path, capsys):
    rows = sample_rows(bench)
    saved = tmp_path / "rows.json"
    bench.write_json(rows, str(saved))
    assert json.loads(saved.read_text()) == rows
    again = tmp_path / "again.json"
    assert bench.main(["--from-json", str(saved), "--json", str(again)]) == 0
    assert json.loads(again.read_text()) == rows
    out = capsys.readouterr().out
    assert out.count("8x512@8192") == 2 and "MISMATCH" in out and "ours/tvm" in out
    assert bench.format_tables(rows) in out


def test_from_json_merges_files_and_skips_other_benches(bench, tmp_path, capsys):
    rows = sample_rows(bench)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    bench.write_json(rows[:5], str(a))
    bench.write_json(rows[5:] + [{"bench": "cache", "kernel": "step", "impl": "tvmattn"}], str(b))
    merged = tmp_path / "merged.json"
    assert bench.main(["--from-json", str(a), str(b), "--json", str(merged)]) == 0
    assert json.loads(merged.read_text()) == rows


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    ('{"kernel": "prefill"}', "expected a JSON list of objects"),
    ('[{"bench": "kernels", "kernel": "prefill", "impl": "tvmattn", "batch": 1, "seq_len": 16}]', "row 0 lacks ms"),
    ('[{"kernel": "prefill", "impl": "x", "batch": 1, "seq_len": 16, "ms": 1.0}]', "row 0 lacks"),
])
def test_from_json_errors(bench, tmp_path, capsys, content, message):
    path = tmp_path / "rows.json"
    if content is not None:
        path.write_text(content)
    assert bench.main(["--from-json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and message in err


def test_plot(bench, tmp_path):
    pytest.importorskip("matplotlib")
    saved, png = tmp_path / "rows.json", tmp_path / "rates.png"
    bench.write_json(sample_rows(bench), str(saved))
    assert bench.main(["--from-json", str(saved), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    saved, png, copy = tmp_path / "rows.json", tmp_path / "rates.png", tmp_path / "copy.json"
    bench.write_json(sample_rows(bench), str(saved))
    assert bench.main(["--from-json", str(saved), "--json", str(copy), "--plot", str(png)]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert copy.exists() and not png.exists()  # the rows were written before the plot failed


# --- the run ----------------------------------------------------------------------------------


def test_without_gpu_exits_2(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench, "gpu_problem", lambda: "the benchmark needs a CUDA GPU, and torch sees none")
    assert bench.main(["--prefill", "1x64"]) == 2
    assert capsys.readouterr().err == "error: the benchmark needs a CUDA GPU, and torch sees none\n"


def test_this_machine_without_gpu_exits_2(bench, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: main() would run the benchmark")
    assert bench.main(["--decode", "--prefill", "1x64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "CUDA GPU" in err and "--from-json" in err and "Traceback" not in err


def test_import_needs_neither_torch_nor_tvm():
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('b', sys.argv[1]);"
            " m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            " print('torch' in sys.modules, 'tvm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, SCRIPT], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_git_commit(bench):
    commit = bench.git_commit().removesuffix("-dirty")
    assert commit == "unknown" or (commit and all(c in "0123456789abcdef" for c in commit))


def test_cpu_smoke_run(bench, monkeypatch, capsys):
    """The run's plumbing (inputs, kernel arguments, SDPA references, agreement, rows) on the CPU:
    tvmattn's and TVM's llvm paged prefill agree with SDPA on a chunked-prefill shape (query i of Q sees
    keys j <= L-Q+i). Decode is left out to keep this file fast (its kernels take seconds to build)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    args = bench.build_parser().parse_args(["--decode", "--prefill", "2x8@40", "--dtype", "float16",
                                            "--head-dim", "64", "--iters", "1"])
    rows = bench.run(args, args.decode, args.prefill)
    out = capsys.readouterr().out
    assert "flashinfer: not installed" in out and "  skip " not in out and "MISMATCH in" not in out, out
    got = {(r["kernel"], r["impl"]): r for r in rows}
    assert set(got) == {("prefill", i) for i in ("tvmattn", "tvm", "sdpa")}
    for (_, impl), row in got.items():
        assert row["device"] == "cpu" and row["ms"] > 0
        if impl != "sdpa":
            assert row["agrees"] and row["max_abs_diff"] < 1e-2, row
    assert got[("prefill", "sdpa")]["variant"] in ("causal_lower_right", "bool-mask")
    assert got[("prefill", "tvmattn")]["qo_len"] == 8 and got[("prefill", "tvmattn")]["seq_len"] == 40


class FakeFunc:
    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


@pytest.mark.parametrize("text, prefix", [("T.ptx.wgmma_mma_async(...)", "wgmma "), ("T.ptx.mma(...)", "mma "),
                                          ("T.exp2(...)", "PrefillSchedule(")])
def test_tvmattn_variant_names_the_tensor_core_path(bench, text, prefix):
    from tir_kernels import AttentionConfig

    config = AttentionConfig(32, 8, 128, dtype="float16", page_size=16, target="cuda:sm_90")
    assert bench.tvmattn_variant("prefill", config, FakeFunc(text)).startswith(prefix)


@pytest.mark.slow
def test_cpu_smoke_run_tree(bench, monkeypatch, capsys):
    """The --tree plumbing on the CPU: tvmattn's tree kernel, its causal prefill and TVM's tree kernel
    (llvm) on a random tree and a chain per request over a history, each against SDPA with the tree's
    mask (the causal one against causal SDPA)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    args = bench.build_parser().parse_args(["--decode", "--prefill", "--tree", "2x6@30", "--dtype", "float16",
                                            "--head-dim", "64", "--iters", "1"])
    rows = bench.run(args, args.decode, args.prefill, bench.tree_shapes(args.tree))
    out = capsys.readouterr().out
    assert "  skip " not in out and "MISMATCH in" not in out, out
    got = {(r["tree"], r["impl"]): r for r in rows}
    assert set(got) == {(form, impl) for form in ("random", "chain")
                        for impl in ("tvmattn", "tvmattn-causal", "tvm", "sdpa")}
    for (_, impl), row in got.items():
        assert row["kernel"] == "tree_prefill" and row["history"] == 24 and row["flops"] == "causal"
        assert row["qo_len"] == 6 and row["seq_len"] == 30 and row["ms"] > 0
        if impl != "sdpa":
            assert row["agrees"] and row["max_abs_diff"] < 1e-2, row


# --- decode timing: warm-up, sample length, CUDA-graph rows -----------------------------------


@pytest.mark.parametrize("iters, per_call, sample, want", [(20, 0.01, 5.0, 500), (20, 0.5, 5.0, 20),
                                                           (20, 0.01, 0.0, 20), (3, 0.0, 5.0, 3),
                                                           (1, 1e-7, 5.0, 20000)])
def test_sample_calls(bench, iters, per_call, sample, want):
    assert bench.sample_calls(iters, per_call, sample) == want


def test_time_ms_warms_up_for_the_time_asked(bench, monkeypatch):
    """warmup_ms of calls before any sample, and samples of at least sample_ms, each call's index
    counted from 0. The host clock (DEVICE cpu) is a fake that only the calls advance, 2**-12 s
    each, so the counts are exact whatever the machine's load."""
    import math
    import time

    per_call_ms = 2.0 ** -12 * 1e3  # a binary fraction of a second: the fake clock adds up exactly
    clock = [1000.0]
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    calls = []

    def fn(i):
        calls.append(i)
        clock[0] += 2.0 ** -12

    ms = bench.time_ms(fn, 2, repeats=3, warmup=3, warmup_ms=30.0, sample_ms=3.0)
    warm = calls.index(0, 1)  # the first sample restarts at index 0
    assert calls[:warm] == list(range(math.ceil(30.0 / per_call_ms)))  # until 30 ms have passed
    assert calls[warm:] == list(range(math.ceil(3.0 / per_call_ms))) * 3  # 3 samples of >= 3 ms
    assert ms == per_call_ms
    calls.clear()
    bench.time_ms(fn, 2, repeats=1, warmup=3)  # no warm-up time, no sample length: the old counts
    assert calls == [0, 1, 2, 0, 1]


def test_graph_rows_get_a_column_of_their_own(bench):
    shape = bench.parse_shape("1x4096", "decode")
    rows = [bench.make_row("decode", "tvmattn", "table", "float16", 128, 16, shape, 0.010, 1e-3, META),
            bench.make_row("decode", "tvmattn", "cuda-graph table", "float16", 128, 16, shape, 0.008, None, META),
            bench.make_row("decode", "sdpa", "dense", "float16", 128, 16, shape, 0.020, None, META),
            bench.make_row("decode", "sdpa", "cuda-graph dense", "float16", 128, 16, shape, 0.016, None, META)]
    assert [bench.display_impl(r) for r in rows] == ["tvmattn", "tvmattn (graph)", "sdpa", "sdpa (graph)"]
    assert bench.is_graph_row(rows[1]) and not bench.is_graph_row(rows[0])
    header, line = bench.format_tables(rows).splitlines()[2:4]
    cols = [c.strip() for c in header.split("|")]
    assert cols[1:5] == ["tvmattn", "tvmattn (graph)", "sdpa", "sdpa (graph)"]
    assert cols[5].split() == ["ours/sdpa"]  # ratios of the eager rows only
    cells = [c.split() for c in line.split("|")]
    assert cells[1][0] == "0.010" and cells[2][0] == "0.008" and cells[5] == ["2.00"]
    assert float(cells[2][1]) == pytest.approx(rows[1]["gbps"], rel=1e-3)


def test_no_graph_option(bench):
    assert bench.build_parser().parse_args([]).no_graph is False
    assert bench.build_parser().parse_args(["--no-graph"]).no_graph is True


@pytest.mark.gpu
def test_graph_time_ms_replays_the_captured_calls():
    """A captured torch call (x += 1, `iters` times) replays as a whole: x counts whole graphs, and
    the time per call is positive and below the eager one's upper bound."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = importlib.util.spec_from_file_location("bench_kernels_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    x = torch.zeros(1, device="cuda", dtype=torch.float64)
    ms = bench.graph_time_ms(lambda i: x.add_(1), 7, repeats=3, warmup_ms=5.0, sample_ms=1.0, tvm_stream=False)
    torch.cuda.synchronize()
    count = int(x.item())
    assert count > 0 and count % 7 == 0
    assert 0 < ms < 1.0


def test_decode_timing_options(bench, capsys):
    args = bench.build_parser().parse_args([])
    assert (args.decode_warmup_ms, args.decode_sample_ms) == (bench.DECODE_WARMUP_MS, bench.DECODE_SAMPLE_MS)
    args = bench.build_parser().parse_args(["--decode-warmup-ms", "0", "--decode-sample-ms", "2.5"])
    assert (args.decode_warmup_ms, args.decode_sample_ms) == (0.0, 2.5)

    class Ctx:
        pass

    ctx = Ctx()
    assert bench.decode_timing(ctx) == {"warmup_ms": bench.DECODE_WARMUP_MS, "sample_ms": bench.DECODE_SAMPLE_MS}
    ctx.warmup_ms, ctx.sample_ms = 7.0, 1.0
    assert bench.decode_timing(ctx) == {"warmup_ms": 7.0, "sample_ms": 1.0}
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            bench.build_parser().parse_args(["--decode-warmup-ms", bad])
        assert "--decode-warmup-ms" in capsys.readouterr().err


def test_kv_dtype_option(bench, capsys):
    args = bench.build_parser().parse_args(["--kv-dtype", "float8_e4m3fn", "float8_e5m2"])
    assert args.kv_dtype == ["float8_e4m3fn", "float8_e5m2"]
    assert bench.build_parser().parse_args([]).kv_dtype == []
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--kv-dtype", "float8_e4m3"])
    assert "--kv-dtype" in capsys.readouterr().err


def test_fp8_decode_bytes_count_one_byte_per_kv_element(bench):
    fp16 = bench.decode_bytes(8, 32768, 32, 8, 128, 2)
    fp8 = bench.decode_bytes(8, 32768, 32, 8, 128, 2, kv_elem_bytes=1)
    qo = 2 * 2 * 8 * 32 * 128
    assert fp16 - qo == 2 * (fp8 - qo) and fp8 - qo == 2 * 8 * 32768 * 8 * 128


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_pool_is_laid_out_as_the_cache_lays_it(bench, fmt):
    """Codes by ml_dtypes at amax / FP8_MAX per (K/V, head), the scales in an extra last page
    (tests/fp8_reference.py, written independently), and the dequantized pool code * scale."""
    torch = pytest.importorskip("torch")
    from fp8_reference import FP8_MAX, dequantize, quantize, with_scales

    pool = torch.randn((3, 2, 4, 16, 64), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    tvm_pool, dequantized, _raw = bench.fp8_pool(pool, fmt)
    x = pool.float().numpy()
    scales = (np.abs(x).max(axis=(0, 3, 4)) / FP8_MAX[fmt]).astype(np.float32)
    codes = quantize(x, scales[None, :, :, None, None], fmt)
    assert tvm_pool.dtype == fmt and tuple(tvm_pool.shape) == (4, 2, 4, 16, 64)
    assert np.array_equal(tvm_pool.numpy().view(np.uint8), with_scales(codes, scales).view(np.uint8))
    expected = dequantize(codes, scales[None, :, :, None, None]).astype(np.float16)
    assert np.array_equal(dequantized.numpy(), expected)


def test_cpu_smoke_run_fp8_prefill(bench, monkeypatch, capsys):
    """--kv-dtype rows on the CPU: the FP8 paged prefill agrees with SDPA on the dequantized K/V
    (the usual tolerance) and with SDPA on the unquantized K/V within FP8's error, but not exactly."""
    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    args = bench.build_parser().parse_args(["--decode", "--prefill", "2x8@40", "--dtype", "float16", "--head-dim", "64",
                                            "--iters", "1", "--no-tvm", "--kv-dtype", "float8_e4m3fn"])
    rows = bench.run(args, args.decode, args.prefill)
    out = capsys.readouterr().out
    assert "  skip " not in out, out
    got = {(r["kernel"], r["impl"]): r for r in rows}
    assert set(got) == {("prefill", i) for i in ("tvmattn", "tvmattn-fp8e4m3", "sdpa")}
    fp8 = got[("prefill", "tvmattn-fp8e4m3")]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["agrees"] and fp8["max_abs_diff"] < 1e-2, fp8
    assert fp8["agrees_vs_unquantized"] and 1e-3 < fp8["max_abs_diff_vs_unquantized"] < 0.1, fp8
    assert fp8["time_vs_fp16"] > 0 and fp8["qo_len"] == 8 and fp8["seq_len"] == 40


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_cpu_smoke_run_fp8_decode(bench, monkeypatch, capsys, fmt):
    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    args = bench.build_parser().parse_args(["--decode", "3x40", "--prefill", "--dtype", "float16", "--head-dim", "64",
                                            "--iters", "1", "--no-tvm", "--kv-dtype", fmt, "--decode-warmup-ms", "0",
                                            "--decode-sample-ms", "0"])
    rows = bench.run(args, args.decode, args.prefill)
    assert "  skip " not in capsys.readouterr().out
    got = {(r["kernel"], r["impl"]): r for r in rows}
    fp8 = got[("decode", bench.FP8_IMPL[fmt])]
    assert fp8["agrees"] and fp8["max_abs_diff"] < 1e-2, fp8
    assert fp8["agrees_vs_unquantized"] and fp8["max_abs_diff_vs_unquantized"] > 1e-3, fp8
    assert fp8["gbps"] == pytest.approx(bench.decode_bytes(3, 40, 32, 8, 64, 2, kv_elem_bytes=1) / fp8["ms"] / 1e6)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("program", ["bench_phase_boundary.cu", "bench_fused_mlp.cu", "bench_l2_lookahead.cu"])
def test_cuda_benchmark_programs_build(program, tmp_path):
    """The CUDA benchmark programs in scripts/ (no Python) compile for sm_90."""
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", program)
    done = subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(tmp_path / "bench"), source],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

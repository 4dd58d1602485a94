"""Specification of the documentation's promises: docs/interface.md names every registered
`tvmattn.*` function (and, in the slow tier, every kernel generator's PrimFunc signature), no file
in docs/ is over 60 KB, docs/bench holds only the latest run of each configuration in under 150 KB,
and the generated performance tables are what scripts/perf_tables.py makes of the committed rows.
None of it needs a GPU."""

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

import bench_latest  # noqa: E402
import bench_rows  # noqa: E402
import perf_tables  # noqa: E402

DOCS = os.path.join(ROOT, "docs")
BENCH = os.path.join(DOCS, "bench")
INTERFACE = os.path.join(DOCS, "interface.md")
MAX_DOC_BYTES = 60_000
MAX_BENCH_BYTES = 210_000  # the latest run of each configuration: rows, not raw sweeps


def interface_text() -> str:
    with open(INTERFACE) as f:
        return f.read()


def names_documented(text: str, names) -> list:
    """The names that do not appear in `text` as a whole word (`tvmattn.x_kv` is not `tvmattn.x_kv_mla`)."""
    return [name for name in names if not re.search(re.escape(name) + r"(?![A-Za-z0-9_])", text)]


# --- docs/interface.md ---------------------------------------------------------------------------


def registered_names() -> list:
    """Every global function named tvmattn.* once the runtime is imported (the registry's view),
    with ffi.py's own tables (so a name registered some other way is not missed either)."""
    import tvm_ffi

    from tvmattn.runtime import ffi

    listed = {name for name in tvm_ffi.registry.list_global_func_names() if name.startswith(ffi.PREFIX)}
    return sorted(listed | {ffi.PREFIX + name for name in (*ffi.API, *ffi.CREATORS)})


def test_every_registered_function_is_in_the_interface():
    names = registered_names()
    assert len(names) >= 20 and "tvmattn.kv_state_begin_forward" in names
    assert names_documented(interface_text(), names) == []


def test_the_name_check_sees_a_missing_name():
    text = "`tvmattn.attention_kv_cache_debug_get_kv_mla` and `tvmattn.kv_state_popn`"
    assert names_documented(text, ["tvmattn.attention_kv_cache_debug_get_kv", "tvmattn.kv_state_popn"]) == [
        "tvmattn.attention_kv_cache_debug_get_kv"]


def prim_func_signature(func) -> str:
    return f"{func.attrs['global_symbol']}({', '.join(p.name for p in func.params)})"


def signature_cases():
    from tir_kernels import AttentionConfig, MLAConfig, SamplingConfig

    mha = AttentionConfig(8, 2, 64, dtype="float16", page_size=16, target="llvm")
    sliding = mha.replace(sliding_window=True)
    mla = MLAConfig(16, 64, 32, dtype="float16", page_size=16, target="llvm")
    return [
        ("paged_decode", (mha,)), ("paged_decode", (sliding,)), ("paged_prefill", (mha,)),
        ("paged_prefill", (sliding,)), ("ragged_prefill", (mha,)), ("tree_mask_paged_prefill", (mha,)),
        ("tree_mask_ragged_prefill", (mha,)), ("merge_state", (mha,)), ("split_rotary", (mha,)),
        ("split_rotary_append", (mha,)), ("transpose_append", (mha,)), ("copy_single_page", (mha,)),
        ("compact_copy", (mha,)), ("debug_get_kv", (mha, 2)), ("mla_paged_decode", (mla,)),
        ("mla_paged_prefill", (mla,)), ("mla_transpose_append", (mla,)), ("mla_copy_single_page", (mla,)),
        ("mla_debug_get_kv", (mla, 2)), ("sample_tokens", (SamplingConfig(),)), ("apply_penalties", (SamplingConfig(),)),
    ]


@pytest.mark.slow
def test_every_kernel_signature_is_in_the_interface():
    """Each generator's PrimFunc, `symbol(param, ...)` in its parameter order, appears verbatim."""
    import tir_kernels

    text = interface_text()
    missing = []
    for name, args in signature_cases():
        signature = prim_func_signature(getattr(tir_kernels, name)(*args))
        if signature not in text:
            missing.append(f"{name}: {signature}")
    assert missing == []


# --- docs/ sizes ----------------------------------------------------------------------------------


def files_under(folder: str) -> dict:
    return {os.path.relpath(os.path.join(d, f), ROOT): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(folder) for f in names}


def test_no_file_in_docs_is_over_60_kb():
    sizes = files_under(DOCS)
    assert sizes and {path: size for path, size in sizes.items() if size > MAX_DOC_BYTES} == {}


def test_docs_bench_is_under_150_kb():
    assert 0 < sum(files_under(BENCH).values()) <= MAX_BENCH_BYTES


# --- docs/bench holds the latest run of each configuration -----------------------------------------


def test_docs_bench_holds_only_latest_runs_as_stored(capsys):
    assert bench_latest.main(["--check", BENCH]) == 0, capsys.readouterr().out


def kernel_row(**fields):
    row = {"bench": "kernels", "kernel": "decode", "impl": "tvmattn", "variant": "table", "dtype": "float16",
           "head_dim": 128, "num_qo_heads": 32, "num_kv_heads": 8, "page_size": 16, "batch": 1, "seq_len": 4096,
           "qo_len": 1, "ms": 0.01, "gbps": 1000.0, "device": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00",
           "commit": "aaaaaaa"}
    row.update(fields)
    return row


def test_a_later_run_replaces_every_point_of_its_configuration():
    old = [kernel_row(batch=1), kernel_row(batch=64), kernel_row(batch=1, variant="cuda-graph table")]
    new = [kernel_row(batch=1, date="2026-01-02T00:00:00+00:00", commit="bbbbbbb")]
    kept = bench_rows.latest_rows({"a.json": old, "b.json": new})
    assert kept == {"a.json": [], "b.json": new}


def test_other_configurations_and_sweeps():
    bf16 = kernel_row(dtype="bfloat16")
    sweep = kernel_row(impl="tvmattn-tc-w4k16s3t264m128-c8-e-h-f", date="2026-01-03T00:00:00+00:00")
    fallback = kernel_row(impl="tvmattn-cuda-core")
    later = kernel_row(date="2026-01-02T00:00:00+00:00")
    kept = bench_rows.latest_rows({"a.json": [bf16, sweep, fallback], "b.json": [later]})
    assert kept == {"a.json": [bf16], "b.json": [later]}


def test_cpu_runs_of_one_day_are_told_apart_by_their_device_line():
    def cpu(load, rate):
        return {"bench": "cpu", "kernel": "decode", "impl": "tvmattn", "variant": "keep", "threads": 2,
                "tokens_per_s": rate, "date": "2026-01-01", "commit": "aaaaaaa", "device": f"2-core CPU (load {load})"}

    rows = [cpu(1.0, 100.0), cpu(2.0, 90.0), {**cpu(2.0, 90.0), "variant": "f32"}]
    assert bench_rows.latest_rows({"cpu.json": rows}) == {"cpu.json": rows[1:]}


def test_rows_of_another_model_supersede_nothing():
    def cpu(model, date):
        return {"bench": "cpu", "model": model, "kernel": "decode", "impl": "tvmattn", "variant": "keep",
                "threads": 2, "tokens_per_s": 1.0, "date": date, "commit": "aaaaaaa", "device": "2-core CPU"}

    smollm2, gemma, later = cpu("a.gguf", "2026-01-01"), cpu("b.gguf", "2026-01-02"), cpu("a.gguf", "2026-01-03")
    assert bench_rows.latest_rows({"cpu.json": [smollm2], "g.json": [gemma]}) == {"cpu.json": [smollm2],
                                                                                 "g.json": [gemma]}
    assert bench_rows.latest_rows({"cpu.json": [smollm2, later]}) == {"cpu.json": [later]}


def test_stored_rows_are_compact_and_one_a_line():
    row = kernel_row(ms=0.0123456789, variant="table: w4k16 at 1x4096, w4k32 at 8x32768", code="work-12 abc")
    stored = bench_rows.stored(row)
    assert stored["ms"] == 0.012346 and stored["variant"] == "table" and "code" not in stored
    text = bench_rows.dumps_rows([stored, stored])
    assert text.count("\n") == 4 and json.loads(text) == [stored, stored]
    assert bench_rows.stored(kernel_row(variant="rotary_mode=1 table: x at 1x4096"))["variant"] == "rotary_mode=1 table"


def test_add_supersedes_and_rewrites(tmp_path):
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "decode.json").write_text(bench_rows.dumps_rows([kernel_row(), kernel_row(batch=64)]))
    (folder / "other.json").write_text(bench_rows.dumps_rows([kernel_row(dtype="bfloat16")]))
    new = tmp_path / "new.json"
    new.write_text(json.dumps([kernel_row(date="2026-01-02T00:00:00+00:00", ms=0.0099999999)]))
    assert bench_latest.main(["--check", str(folder)]) == 0
    assert bench_latest.main([str(folder), "--add", str(new), "--into", "decode.json"]) == 0
    assert json.loads((folder / "decode.json").read_text()) == [kernel_row(date="2026-01-02T00:00:00+00:00", ms=0.01)]
    assert json.loads((folder / "other.json").read_text()) == [kernel_row(dtype="bfloat16")]
    assert bench_latest.main(["--check", str(folder)]) == 0


# --- generated tables -------------------------------------------------------------------------------


def test_the_committed_tables_are_what_the_rows_give():
    stale = [os.path.relpath(path, ROOT) for path, (old, new) in perf_tables.render().items() if old != new]
    assert stale == [], "run python scripts/perf_tables.py"


def test_every_table_is_placed_once():
    text = "".join(open(path).read() for path in (perf_tables.PERFORMANCE, perf_tables.README))
    placed = re.findall(r"<!-- table:([\w-]+) -->", text)
    assert sorted(placed) == sorted(perf_tables.TABLES)


def test_a_table_follows_its_rows(tmp_path):
    folder = tmp_path / "bench"
    folder.mkdir()
    rows = [kernel_row(impl=impl, batch=b, seq_len=s, gbps=rate + b)
            for impl, rate in (("tvmattn", 4000.0), ("sdpa", 3000.0)) for b, s in perf_tables.DECODE_SHAPES]
    (folder / "decode.json").write_text(bench_rows.dumps_rows(rows))
    text = perf_tables.decode_table(perf_tables.Rows(str(folder)))
    assert "| 4, fp16 | tvmattn | 4001 | 4001 | 4008 | 4064 | 4128 | 4256 |" in text
    assert "| | torch SDPA | 3001 |" in text.replace("|  |", "| |")
    assert "`docs/bench/decode.json` (aaaaaaa, 2026-01-01)" in text


def test_markers_must_pair_and_name_a_table():
    with pytest.raises(ValueError, match="unknown table"):
        perf_tables.replace_tables("<!-- table:nope -->\nx\n<!-- /table:nope -->", {"decode": "t"}, "f.md")
    with pytest.raises(ValueError, match="do not pair"):
        perf_tables.replace_tables("<!-- table:decode -->\nx\n", {"decode": "t"}, "f.md")
    assert perf_tables.replace_tables("a\n<!-- table:decode -->\nold\n<!-- /table:decode -->\nb", {"decode": "new"},
                                      "f.md") == "a\n<!-- table:decode -->\nnew\n<!-- /table:decode -->\nb"

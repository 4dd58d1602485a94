"""The benchmark scripts' --json rows without a GPU: scripts/bench_rows.py (commit, date, device,
JSON writing), the rows of scripts/bench_e2e.py (its run needs two compiled model libraries: minutes
even for a tiny model on the CPU, so only its row building and options are tested here) and of
scripts/bench_cache.py (its row building, and one tiny CPU run of TVM's C++ cache with --json)."""

import datetime
import json
import os
import platform
import sys
import time
import types

import numpy as np
import pytest
import tvm

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

import bench_rows  # noqa: E402
from harness import load_script  # noqa: E402

META = {"device": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00", "commit": "abc1234"}
# shared/docs/bench-format.md: the fields every row of these benchmarks carries
COMMON_FIELDS = ("bench", "kernel", "impl", "batch", "seq_len", "ms", "device", "date", "commit")


@pytest.fixture(scope="module")
def e2e():
    return load_script("bench_e2e")


@pytest.fixture(scope="module")
def cache_bench():
    return load_script("bench_cache")


# --- scripts/bench_rows.py ---------------------------------------------------------------------


def test_git_commit():
    commit = bench_rows.git_commit().removesuffix("-dirty")
    assert commit == "unknown" or (4 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit))


def test_git_commit_marks_a_changed_tree(tmp_path):
    """A run from a tree whose tracked files differ from HEAD is not HEAD's code: "-dirty"."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "kernel.py").write_text("a = 1\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "one")
    head = bench_rows.git_commit(str(tmp_path))
    assert all(c in "0123456789abcdef" for c in head)
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert bench_rows.git_commit(str(tmp_path)) == head
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert bench_rows.git_commit(str(tmp_path)) == head + "-dirty"


def test_git_commit_outside_a_repository(tmp_path):
    assert bench_rows.git_commit(str(tmp_path)) == "unknown"
    assert bench_rows.git_commit(str(tmp_path / "missing")) == "unknown"


def test_now_iso():
    text = bench_rows.now_iso()
    stamp = datetime.datetime.fromisoformat(text)
    assert stamp.utcoffset() == datetime.timedelta(0) and "." not in text
    assert abs((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds()) < 60


def test_cpu_device_name():
    assert bench_rows.device_name(gpu=False) == (platform.processor() or "cpu")


def fake_torch(available):
    cuda = types.SimpleNamespace(is_available=lambda: available, get_device_name=lambda *a: "NVIDIA H200")
    return types.SimpleNamespace(cuda=cuda)


def test_gpu_device_name_from_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True))
    assert bench_rows.device_name() == "NVIDIA H200"
    assert bench_rows.device_name(gpu=False) == (platform.processor() or "cpu")


def test_gpu_device_name_without_a_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False))
    fake_tvm = types.SimpleNamespace(cuda=lambda i: types.SimpleNamespace(exist=False, device_name=None))
    monkeypatch.setitem(sys.modules, "tvm", fake_tvm)
    assert bench_rows.device_name() == (platform.processor() or "cpu")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    fake_tvm.cuda = lambda i: types.SimpleNamespace(exist=True, device_name="NVIDIA H200")
    assert bench_rows.device_name() == "NVIDIA H200"


def test_run_meta(monkeypatch):
    monkeypatch.setattr(bench_rows, "git_commit", lambda: "abc1234")
    meta = bench_rows.run_meta(gpu=False)
    assert list(meta) == ["device", "date", "commit"]
    assert meta["device"] == (platform.processor() or "cpu") and meta["commit"] == "abc1234"
    datetime.datetime.fromisoformat(meta["date"])


def test_write_rows_round_trip(tmp_path, capsys):
    rows = [{"bench": "e2e", "kernel": "decode", "impl": "tvmattn", "batch": 1, "seq_len": 512, "ms": 1.5,
             "agrees": True, **META}, {"bench": "e2e", "kernel": "decode", "impl": "tvm-stock-cache", "ms": 2.0}]
    path = tmp_path / "rows.json"
    path.write_text("old contents, replaced")
    bench_rows.write_rows(rows, str(path))
    assert capsys.readouterr().out == f"wrote 2 rows to {path}\n"
    text = path.read_text()
    assert json.loads(text) == rows and text.endswith("]\n")
    bench_rows.write_json([], str(path))
    assert json.loads(path.read_text()) == []


def test_output_path_problem(tmp_path):
    assert bench_rows.output_path_problem(None) is None
    assert bench_rows.output_path_problem(str(tmp_path / "rows.json")) is None
    assert bench_rows.output_path_problem("rows.json") is None  # the current folder
    assert "does not exist" in bench_rows.output_path_problem(str(tmp_path / "missing" / "rows.json"))


def test_bench_kernels_uses_the_helper():
    bench = load_script("bench_kernels")
    assert bench.git_commit is bench_rows.git_commit and bench.write_json is bench_rows.write_json


# --- scripts/bench_e2e.py ----------------------------------------------------------------------


def test_stream_shares_split_overlapped_kernels_at_their_predecessors_end(e2e):
    """--profile's stream breakdown: a kernel started early (programmatic dependent launch) and
    waiting is charged only from its predecessor's end; gaps count for nobody; shares add up."""
    kernels = [("qkv", 0.0, 2.0), ("attention", 1.0, 6.0), ("o_proj", 5.0, 7.5),  # overlapping starts
               ("qkv", 10.0, 12.0), ("attention", 11.5, 16.0), ("o_proj", 17.0, 18.0)]  # a gap before o_proj
    shares, busy = e2e.stream_shares(list(reversed(kernels)))  # (any order: sorted by start)
    assert shares == {"qkv": (4.0, 2), "attention": (8.0, 2), "o_proj": (2.5, 2)}
    assert busy == pytest.approx(14.5) == sum(total for total, _ in shares.values())
    assert e2e.stream_shares([]) == ({}, 0.0)


def test_sequences_hold_a_host_profiles_steps(e2e):
    """--profile-host runs PROFILE_STEPS more decode steps than a short --steps run times: each
    sequence's pages (and the library's context) hold them."""
    short = e2e.parse_args(["--steps", "4", "--prompt-len", "32"])
    profiled = e2e.parse_args(["--steps", "4", "--prompt-len", "32", "--profile-host", "16"])
    assert e2e.sequence_tokens(short) == 32 + 4 + e2e.WARMUP_STEPS + 8
    assert e2e.sequence_tokens(profiled) == 32 + e2e.PROFILE_STEPS + e2e.WARMUP_STEPS + 8


def test_e2e_prefill_row(e2e):
    row = e2e.make_row("prefill", "tvm", batch=1, prompt_len=512, seconds=0.004, diff=1e-3, scale=20.0,
                       target="cuda", dtype="float16", meta=META, extra={"model": "smollm2-135m", "page_size": 16})
    assert row["bench"] == "e2e" and row["kernel"] == "prefill" and row["impl"] == "tvm-stock-cache"
    assert (row["batch"], row["qo_len"], row["seq_len"]) == (1, 512, 512)
    assert row["ms"] == pytest.approx(4.0) and row["tokens_per_s"] == pytest.approx(128000.0)
    assert row["max_abs_diff"] == 1e-3 and row["agrees"] is True
    assert row["variant"] == "cuda/float16" and row["dtype"] == "float16"
    assert row["model"] == "smollm2-135m" and row["page_size"] == 16 and "host_ms" not in row
    assert all(field in row for field in COMMON_FIELDS)
    assert list(row)[-3:] == ["device", "date", "commit"] and row["commit"] == "abc1234"
    json.dumps(row)  # flat and serializable


def test_e2e_decode_row(e2e):
    timing = e2e.DecodeTiming(step_s=0.002, host_s=0.0015, plan_s=0.0005)
    row = e2e.make_row("decode", "tvmattn", batch=16, prompt_len=512, seconds=timing.step_s, diff=0.5, scale=10.0,
                       target="llvm", dtype="float32", meta=META, timing=timing)
    assert row["impl"] == "tvmattn" and row["kernel"] == "decode"
    assert (row["batch"], row["qo_len"], row["seq_len"]) == (16, 1, 512)
    assert row["ms"] == pytest.approx(2.0) and row["tokens_per_s"] == pytest.approx(8000.0)
    assert row["host_ms"] == pytest.approx(1.5) and row["begin_forward_ms"] == pytest.approx(0.5)
    assert row["embed_ms"] == row["choose_ms"] == row["wait_ms"] == 0.0  # (parts the timing left at 0)
    assert row["agrees"] is False  # 0.5 > 2e-2 * 10
    assert all(isinstance(v, (str, int, float, bool)) for v in row.values())
    assert "gpu_ms" not in row  # an eager step: no graph replayed alone
    graph = e2e.DecodeTiming(step_s=0.002, host_s=0.0015, plan_s=0.0, gpu_s=0.0018)
    row = e2e.make_row("decode", "graph", batch=16, prompt_len=512, seconds=graph.step_s, diff=0.0, scale=10.0,
                       target="cuda", dtype="float16", meta=META, timing=graph)
    assert row["impl"] == "tvmattn-cuda-graph" and row["gpu_ms"] == pytest.approx(1.8)


def test_e2e_agreement(e2e):
    assert e2e.agrees(1e-2, 0.1) and not e2e.agrees(3e-2, 0.1)  # scale at least 1
    assert e2e.agrees(0.3, 20.0) and not e2e.agrees(0.5, 20.0)
    assert not e2e.agrees(float("nan"), 1.0)
    with pytest.raises(ValueError, match="kernel"):
        e2e.make_row("step", "tvm", batch=1, prompt_len=1, seconds=1.0, diff=0.0, scale=1.0, target="cuda",
                     dtype="float16", meta={})


def test_e2e_json_option(e2e, tmp_path, capsys):
    assert e2e.parse_args([]).json is None
    assert e2e.parse_args(["--json", str(tmp_path / "e2e.json")]).json == str(tmp_path / "e2e.json")
    with pytest.raises(SystemExit) as exit_info:
        e2e.parse_args(["--json", str(tmp_path / "missing" / "e2e.json")])
    assert exit_info.value.code == 2 and "argument --json" in capsys.readouterr().err


def test_e2e_own_configuration_options(e2e, tmp_path, capsys):
    """--no-dependent-launch, --no-tensor-core-matmul, --no-decode-append and --fused-batch-layers
    build libraries of their own name (never the ordinary ones of the folder), refuse an existing
    library built otherwise and the CPU target; their rows form configurations of their own
    (bench_rows.CONFIG_FIELDS), while the ordinary rows carry no such field."""
    # both are the CUDA default (the present GPU's arch, else sm_90): the flags turn them off
    default = e2e.parse_args(["--libs", str(tmp_path)])
    assert default.name == "smollm2" and default.dependent_launch and default.tensor_core_matmul
    assert default.decode_append and default.own_config == {}
    cpu = e2e.parse_args(["--target", "llvm"])
    assert not cpu.dependent_launch and not cpu.tensor_core_matmul and cpu.own_config == {}
    args = e2e.parse_args(["--no-dependent-launch", "--libs", str(tmp_path)])
    assert not args.dependent_launch and args.name == "smollm2-nopdl"
    assert e2e.library_path(args, "graph") == tmp_path / "smollm2-nopdl-tvmattn.so"
    assert args.tensor_core_matmul and args.own_config == {"dependent_launch": False}
    for flag in ("--no-dependent-launch", "--no-tensor-core-matmul", "--no-decode-append", "--fused-batch-layers"):
        with pytest.raises(SystemExit) as exit_info:
            e2e.parse_args([flag, "--target", "llvm"])
        assert exit_info.value.code == 2 and f"argument {flag}: needs --target cuda" in capsys.readouterr().err
    both = e2e.parse_args(["--no-dependent-launch", "--no-tensor-core-matmul"])
    assert not both.tensor_core_matmul and both.name == "smollm2-nopdl-cc"
    assert both.own_config == {"dependent_launch": False, "tensor_core_matmul": False}
    separate = e2e.parse_args(["--no-decode-append", "--libs", str(tmp_path)])
    assert separate.name == "smollm2-noda" and separate.own_config == {"decode_append": False}
    fused = e2e.parse_args(["--fused-batch-layers", "--libs", str(tmp_path)])
    assert fused.name == "smollm2-fb" and fused.own_config == {"fused_batch_layers": True}
    library = tmp_path / "smollm2-tvmattn.so"
    runtime = e2e.sidecar(library, e2e.RUNTIME_SUFFIX)
    for built, run in ((False, default), (True, args)):
        runtime.write_text(json.dumps({"metadata": {"build_options": {"dependent_launch": built,
                                                                      "tensor_core_matmul": True,
                                                                      "decode_append": True}}}))
        with pytest.raises(SystemExit, match=f"was built with dependent_launch={built}, this run builds "
                                             f"dependent_launch={not built}"):
            e2e.check_own_config_builds(run, library)
    e2e.check_own_config_builds(default, library)  # built as this run builds: used as it is
    # a library from before the default (built without the tensor-core matmul) is not taken for it
    runtime.write_text(json.dumps({"metadata": {"build_options": {"dependent_launch": True,
                                                                  "tensor_core_matmul": False,
                                                                  "decode_append": True}}}))
    with pytest.raises(SystemExit, match="was built with tensor_core_matmul=False, this run builds "
                                         "tensor_core_matmul=True"):
        e2e.check_own_config_builds(default, library)
    row = {"bench": "e2e", "kernel": "decode", "impl": "tvmattn-cuda-graph", "variant": "cuda/float16",
           "fused_layers": "decode", "batch": 1}
    assert bench_rows.config_key({**row, "dependent_launch": False}) != bench_rows.config_key(row)
    assert bench_rows.config_key({**row, "tensor_core_matmul": True}) != bench_rows.config_key(row)
    assert bench_rows.config_key({**row, "decode_append": False}) != bench_rows.config_key(row)


def test_e2e_target_that_cannot_be_built_is_an_argument_error(e2e, monkeypatch, capsys):
    def refuse(target, cuda_arch=None):
        raise e2e.BuildError("--target 'cuda': nvcc here cannot build sm_90")

    monkeypatch.setattr(e2e, "resolve_target", refuse)
    with pytest.raises(SystemExit) as exit_info:
        e2e.parse_args([])
    assert exit_info.value.code == 2
    assert "argument --target: --target 'cuda': nvcc here cannot build sm_90" in capsys.readouterr().err


def test_a_run_replaces_only_the_rows_of_its_machine_kind():
    """An H100 run keeps the H200 rows of the same configuration; CPU runs (whose `device` names
    the load seen) replace each other."""
    row = {"bench": "e2e", "kernel": "decode", "impl": "tvmattn", "variant": "cuda/float16", "batch": 1}

    def run(device, date):
        return {**row, "device": device, "date": date, "commit": "c"}

    h200, h100 = run("NVIDIA H200", "2026-01-01"), run("NVIDIA H100 80GB HBM3", "2026-01-02")
    kept = bench_rows.latest_rows({"a.json": [h200], "b.json": [h100]})
    assert kept == {"a.json": [h200], "b.json": [h100]}
    old_cpu, new_cpu = run("2-core CPU (load 1.0)", "2026-01-01"), run("2-core CPU (load 2.0)", "2026-01-02")
    assert bench_rows.latest_rows({"c.json": [old_cpu, new_cpu]}) == {"c.json": [new_cpu]}
    later_h200 = run("NVIDIA H200", "2026-01-03")
    assert bench_rows.latest_rows({"a.json": [h200, later_h200]}) == {"a.json": [later_h200]}


# --- scripts/bench_cache.py --------------------------------------------------------------------


def measurement(cache_bench, cache, outputs, wall_ms=2.0):
    return cache_bench.Measurement(cache, cache_bench.Workload(4, 1024), host_ms=0.5, wall_ms=wall_ms,
                                   first_outputs=tuple(outputs))


def test_cache_rows(cache_bench):
    import numpy as np

    model = cache_bench.ModelShape(32, 32, 8, 128, "float16", 16)
    options = cache_bench.BenchOptions(warmup=2, steps=7)
    base = measurement(cache_bench, "tvm-cpp+tvm", [np.zeros((4, 32, 128), "float16")] * 2)
    ours = measurement(cache_bench, "tvmattn", [np.zeros((4, 32, 128), "float16"),
                                                np.full((4, 32, 128), 0.25, "float16")], wall_ms=1.0)
    row = cache_bench.make_row(model, options, ours, "cuda:sm_90", META, base)
    assert row["bench"] == "cache" and row["kernel"] == "step" and row["impl"] == "tvmattn"
    assert (row["batch"], row["seq_len"], row["qo_len"]) == (4, 1024, 1)
    assert row["ms"] == 1.0 and row["host_ms"] == 0.5 and row["steps"] == 7 and row["warmup"] == 2
    assert row["max_abs_diff"] == 0.25 and row["reference"] == "tvm-cpp+tvm"
    assert (row["dtype"], row["head_dim"], row["num_qo_heads"], row["num_kv_heads"], row["page_size"]) == \
        ("float16", 128, 32, 8, 16)
    assert all(field in row for field in COMMON_FIELDS) and row["variant"] == "cuda:sm_90"
    baseline_row = cache_bench.make_row(model, options, base, "cuda:sm_90", META)
    assert "max_abs_diff" not in baseline_row and baseline_row["impl"] == "tvm-cpp+tvm"
    json.dumps([row, baseline_row])


def test_cache_json_option_refuses_a_missing_folder(cache_bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cache_bench.main(["--device", "cpu", "--json", str(tmp_path / "missing" / "cache.json")])
    assert exit_info.value.code == 2 and "argument --json" in capsys.readouterr().err


def test_cache_cpu_run_writes_rows(cache_bench, tmp_path, capsys):
    """One tiny CPU run of TVM's C++ cache with its own kernels (the quickest to build): the table
    prints as without --json, then the rows go to the file."""
    path = tmp_path / "cache.json"
    cache_bench.main(["--device", "cpu", "--workloads", "2x16", "--caches", "tvm-cpp+tvm", "--warmup", "1",
                      "--steps", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert "tvm-cpp+tvm" in out and out.endswith(f"wrote 1 rows to {path}\n")
    (row,) = json.loads(path.read_text())
    assert row["bench"] == "cache" and row["impl"] == "tvm-cpp+tvm" and row["variant"] == "llvm"
    assert (row["batch"], row["seq_len"]) == (2, 16) and row["ms"] > 0 and row["host_ms"] > 0
    assert row["device"] == (platform.processor() or "cpu") and row["commit"] == bench_rows.git_commit()


class _StepLog:
    """A stand-in for bench_e2e.Runner that records its calls in order (no library runs)."""

    def __init__(self, ordered_uploads: bool, vocab: int = 8):
        self.ordered_uploads, self.vocab, self.calls = ordered_uploads, vocab, []
        self.sync_s = 0.0  # seconds each sync takes
        self.device, self.cache, self.plan_s, self.host_s, self.embed_s = tvm.cpu(0), None, 0.0, 0.0, 0.0
        self.graphs = None  # (eager steps: no graph replays to time)
        self.host = {"add_sequence": lambda cache, seq_id: None, "remove_sequence": lambda cache, seq_id: None}

    def prefill(self, seq_id, ids):
        self.calls.append("prefill")

    def sync(self):
        self.calls.append("sync")
        time.sleep(self.sync_s)

    def decode(self, seq_ids, tokens):
        self.calls.append("decode")
        return tvm.runtime.tensor(np.zeros((len(seq_ids), 1, self.vocab), np.float32))


@pytest.mark.parametrize("ordered", [True, False], ids=["tvmattn", "tvm-stock"])
def test_e2e_stock_cache_steps_wait_for_the_previous_step(e2e, ordered):
    """bench_decode: our cache's steps run back to back; TVM's stock cache (its plan upload is not
    ordered after the running step) is synchronized before every decode step, warm-up included."""
    runner = _StepLog(ordered)
    e2e.bench_decode(runner, [np.zeros(4, np.int32)] * 2, steps=5)
    steps = [i for i, call in enumerate(runner.calls) if call == "decode"]
    assert len(steps) == e2e.WARMUP_STEPS + 5
    waited = [runner.calls[i - 1] == "sync" for i in steps]
    # ours: only after the prefills and before the timed steps (the warm-up's end)
    assert waited == [not ordered or i in (0, e2e.WARMUP_STEPS) for i in range(len(steps))]


@pytest.mark.parametrize("ordered", [True, False], ids=["tvmattn", "tvm-stock"])
def test_e2e_decode_timing_splits_the_host_time(e2e, ordered):
    """bench_decode's timing: the stock cache's wait for the previous step (each sync before a
    timed step) and the choice of the next tokens, per step, apart from the forward's host time."""
    runner = _StepLog(ordered)
    runner.sync_s = 0.002
    timing, _ = e2e.bench_decode(runner, [np.zeros(4, np.int32)] * 2, steps=4)
    assert (timing.wait_s >= 0.002) == (not ordered) and timing.wait_s < timing.step_s
    assert 0 < timing.choose_s < timing.step_s and timing.embed_s == 0.0
    row = e2e.make_row("decode", "tvmattn" if ordered else "tvm", batch=2, prompt_len=4, seconds=timing.step_s,
                       diff=0.0, scale=1.0, target="llvm", dtype="float32", meta=META, timing=timing)
    assert row["wait_ms"] == pytest.approx(1e3 * timing.wait_s) and row["choose_ms"] > 0 and row["embed_ms"] == 0


def test_e2e_rounds_alternate_the_libraries_and_report_the_median(e2e, capsys):
    """--rounds N: round r times the libraries rotated by r (none always first); a library's
    reported timing is its median round (the lower middle one of an even count)."""
    libraries = ("tvmattn", "graph", "tvm")
    assert [e2e.round_order(libraries, r) for r in range(4)] == [
        libraries, ("graph", "tvm", "tvmattn"), ("tvm", "tvmattn", "graph"), libraries]
    timing = e2e.DecodeTiming
    odd = [timing(3e-3, 2e-3, 1e-4), timing(1e-3, 5e-4, 1e-4), timing(2e-3, 1e-3, 1e-4)]
    assert e2e.median_round(odd) is odd[2]
    assert e2e.median_round(odd + [timing(4e-3, 3e-3, 1e-4)]) is odd[2]
    assert e2e.median_round(odd[:1]) is odd[0]
    assert e2e.parse_args(["--rounds", "3"]).rounds == 3 and e2e.parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        e2e.parse_args(["--rounds", "0"])
    assert "argument --rounds: expected at least 1, got 0" in capsys.readouterr().err


def test_finish_writes_the_rows_then_reports_the_failures(tmp_path, capsys):
    """A benchmark's ending: rows to --json when given, failed checks on one line, status 1."""
    rows = [{"bench": "kernels", "ms": 1.0}]
    path = tmp_path / "rows.json"
    assert bench_rows.finish(rows, str(path), [], "FAILED: ") == 0
    assert json.loads(path.read_text()) == rows
    assert bench_rows.finish(rows, None, ["a", "b"], "FAILED (x): ", "; ") == 1
    out = capsys.readouterr().out
    assert f"wrote 1 rows to {path}" in out and out.rstrip().endswith("FAILED (x): a; b")

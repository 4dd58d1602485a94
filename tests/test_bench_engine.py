"""Specification of scripts/bench_engine.py on the tiny random-weight library (CPU): rows for
each batch with the engine waiting for every step and with lookahead steps, the same tokens in
both (the script checks them), and lookahead steps counted only where they ran."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from serve_support import tiny_library

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "scripts" / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_compare_lookahead_with_waiting_steps(bench, tmp_path, capsys):
    out = tmp_path / "engine.json"
    status = bench.main(["--lib", str(tiny_library()), "--batches", "1,3", "--prompt-len", "9", "--new-tokens", "7",
                         "--rounds", "1", "--json", str(out)])
    assert status == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["variant"]) for r in rows] == [(1, "wait"), (1, "lookahead"), (3, "wait"), (3, "lookahead")]
    for row in rows:
        assert row["bench"] == "engine" and row["tokens_per_s"] > 0 and row["ms"] > 0 and row["new_tokens"] == 7
        assert (row["lookahead_steps"] > 0) == (row["variant"] == "lookahead")
        assert row["device"] and row["commit"]


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--lib", "x.so", "--new-tokens", "1"])
    assert "--new-tokens >= 2" in capsys.readouterr().err

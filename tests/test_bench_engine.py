"""Specification of scripts/bench_engine.py on the tiny random-weight library (CPU): rows for
each batch with the engine waiting for every step and with lookahead steps, the same tokens in
both (the script checks them), and lookahead steps counted only where they ran."""

from __future__ import annotations

import json

import pytest

from harness import load_script
from serve_support import tiny_library


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_engine")


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

"""`python -m tvmattn demo`: the typed run_demo and its thin command line."""

import pytest

from tvmattn import __version__
from tvmattn.__main__ import main
from tvmattn.demo import format_report, run_demo


def test_run_demo(target):
    report = run_demo(dtype="float16", page_size=16, target=target)
    assert set(report["kernels"]) == {"paged_prefill", "paged_decode"}
    for name, result in report["kernels"].items():
        assert result["o_max_abs_err"] <= result["o_tolerance"][1], name
        assert result["build_seconds"] > 0
    assert report["passed"]
    assert "PASSED" in format_report(report)


@pytest.mark.slow
def test_run_demo_other_dtype_and_page_size():
    report = run_demo(dtype="float32", page_size=8)
    assert report["passed"], format_report(report)


@pytest.mark.slow
def test_cli_demo(capsys):
    assert main(["demo", "--page-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "paged_prefill" in out and "paged_decode" in out and "PASSED" in out


def test_cli_rejects_bad_page_size(capsys):
    with pytest.raises(SystemExit) as exit_:  # refused while parsing
        main(["demo", "--page-size", "3"])
    assert exit_.value.code == 2
    assert "page_size=3 is not supported" in capsys.readouterr().err


def test_cli_version(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert __version__ in capsys.readouterr().out

"""scripts/durations_table.py: the README's table of the slowest tests, from pytest's own output."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import durations_table  # noqa: E402

LOG = """\
........................................................................ [ 97%]
=============================== slowest 3 durations ===============================
86.74s setup    tests/test_generate.py::test_compile_writes_library_weights_and_runtime
29.50s call     tests/test_main_job.py::test_main_job_answers_with_a_small_gguf_on_the_cpu
6.41s call     tests/test_generate.py::test_compile_cli_argument_errors[args0-target='tpu' is not supported]
=============================== warnings summary ===============================
976 passed, 730 skipped, 172 deselected, 2 warnings in 772.33s (0:12:52)
"""
README = "# x\n\n## Tests\n\n```\npython -m pytest -q\n```\n\n## Usage\n\nuse it\n"


def test_the_table_goes_at_the_end_of_the_tests_section_and_is_replaced_in_place(tmp_path):
    log, readme = tmp_path / "log", tmp_path / "README.md"
    log.write_text(LOG)
    readme.write_text(README)
    assert durations_table.main([str(log), "--readme", str(readme)]) == 0
    text = readme.read_text()
    tests, usage = text.split("## Usage")
    assert usage == "\n\nuse it\n" and tests.startswith(README.split("## Usage")[0].rstrip("\n"))
    block = tests.split(durations_table.BEGIN)[1].split(durations_table.END)[0]
    assert "`976 passed, 730 skipped, 172 deselected, 2 warnings in 772.33s (0:12:52)`" in block
    assert sum(line.startswith("|") for line in block.splitlines()) == 5  # header, rule, three rows
    assert "| 86.7 | setup | `tests/test_generate.py::test_compile_writes_library_weights_and_runtime` |" in block
    assert block.index("| 86.7 |") < block.index("| 29.5 |") < block.index("| 6.4 |")
    assert "not supported]` |" in block  # a test id with spaces kept whole
    log.write_text(LOG.replace("86.74s", "12.00s"))
    durations_table.main([str(log), "--readme", str(readme)])
    again = readme.read_text()
    assert again.count(durations_table.BEGIN) == 1 and "| 12.0 | setup |" in again and "86.7" not in again


@pytest.mark.parametrize("log, problem", [("1 passed in 2.0s\n", "no 'slowest durations' report"),
                                          (LOG.splitlines()[1] + "\n1.0s call t.py::x\n", "no summary line")])
def test_a_log_without_durations_or_summary_is_an_error(tmp_path, capsys, log, problem):
    (tmp_path / "log").write_text(log)
    (tmp_path / "README.md").write_text(README)
    assert durations_table.main([str(tmp_path / "log"), "--readme", str(tmp_path / "README.md")]) == 2
    assert problem in capsys.readouterr().err and (tmp_path / "README.md").read_text() == README

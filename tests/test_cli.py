"""Specification of the command line's argument checks (`python -m tvmattn ...`,
scripts/compile.py): every argument is checked while parsing, before TVM is imported or a
library is loaded, and a bad one ends as `error: ...` naming it, with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tvmattn.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "--lib", "missing.so", "--prompt", "hi"]
COMPILE = ["compile", "--model", "smollm2-135m", "-o", "x.so"]


@pytest.mark.parametrize("args, message", [
    (GENERATE + ["--temperature", "nan"], "argument --temperature: expected a number in [0, 100], got 'nan'"),
    (GENERATE + ["--temperature", "inf"], "argument --temperature"),
    (GENERATE + ["--temperature", "-0.5"], "argument --temperature"),
    (GENERATE + ["--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (GENERATE + ["--seed", "1.5"], "argument --seed: expected an integer, got '1.5'"),
    (GENERATE + ["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got 0"),
    (GENERATE + ["--top-p", "0"], "argument --top-p: expected a number in (0, 1]"),
    (GENERATE + ["--top-p", "1.5"], "argument --top-p"),
    (["generate", "--lib", "model.bin", "--prompt", "hi"], "argument --lib: 'model.bin': expected a library file"),
    (["smollm2", "--max-new-tokens", "0"], "argument --max-new-tokens"),
    (["smollm2", "--target", "rocm"], "argument --target: target='rocm' is not supported"),
    (["smollm2", "--gguf", "/no/such.gguf"], "argument --gguf: '/no/such.gguf': expected an existing .gguf file"),
    (COMPILE + ["--page-size", "0"], "argument --page-size: page_size=0 is not supported"),
    (COMPILE + ["--page-size", "256"], "a power of two from 1 to 128"),
    (COMPILE + ["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (COMPILE + ["--cuda-arch", "hopper"], "argument --cuda-arch: 'hopper' is not a CUDA arch"),
    (COMPILE + ["--context-window", "-4"], "argument --context-window: expected an integer >= 1, got -4"),
    (["compile", "--model", "/no/such/model", "-o", "x.so"], "argument --model: '/no/such/model': no such file"),
    (["demo", "--target", "cuda:90"], "argument --target: target='cuda:90' is not supported"),
    (["demo", "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
])
def test_bad_arguments_are_refused_while_parsing(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_every_option_has_a_help_line_with_its_default():
    from tvmattn.__main__ import parser

    commands = parser()._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help line"
    text = commands["compile"].format_help()
    assert "(default: 16)" in text and "(default: auto)" in text and "(default: tvmattn)" in text
    assert "(default: 1.0)" in commands["generate"].format_help()  # --top-p


def test_help_does_not_import_tvm():
    """`python -m tvmattn --help` answers without importing TVM (about 3 s)."""
    for args in (["--help"], ["compile", "--help"], ["generate", "--help"]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tvmattn", *args], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0 and "usage:" in done.stdout
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
        assert "tvm" not in imported and "tvm_ffi" not in imported


def test_scripts_compile_is_the_compile_command():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--prefill-chunk" in done.stdout and "(default: 4)" in done.stdout

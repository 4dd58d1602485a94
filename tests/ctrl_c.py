"""Ctrl-C at a named stage of `python -m tvmattn COMMAND ...`, deterministically.

A signal sent after a delay lands in whatever stage the child has reached by then, which depends
on the machine's load. Instead, the child (this file run as a script) wraps one function of the
stage so that the process sends itself SIGINT there: `signal.raise_signal` delivers it to the
calling thread and runs the Python handler (the command line's own) before it returns, so the
interruption happens exactly at that point, through the real signal path. Before it, the child
writes `MARKER STAGE` to stderr, so that a test can tell that the stage was reached.

    python tests/ctrl_c.py [--fake-compile] STAGE COMMAND ARGS...

--fake-compile: `compile_module` returns a stand-in executable that writes a small file, so
that only the stages around it run (a test of the writing stages need not wait for a compile).
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "ctrl_c: SIGINT at"
# fused-QKV attention, which the compiled model calls once per layer and step from inside the VM
ATTENTION = "tvmattn.attention_kv_cache_attention_with_fused_qkv"


def ctrl_c(stage: str) -> None:
    print(f"{MARKER} {stage}", file=sys.stderr, flush=True)
    signal.raise_signal(signal.SIGINT)


def _replace(module: str, name: str, make) -> None:
    """Replace function `module.name` with make(original), in every loaded module that imported it."""
    original = getattr(importlib.import_module(module), name)
    wrapper = functools.wraps(original)(make(original))
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__dict__", {}).get(name) is original:
            setattr(loaded, name, wrapper)


def _before(stage: str, module: str, name: str) -> None:
    def make(original):
        def wrapper(*args, **kwargs):
            ctrl_c(stage)
            return original(*args, **kwargs)
        return wrapper
    _replace(module, name, make)


def _after(stage: str, module: str, name: str) -> None:
    def make(original):
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            ctrl_c(stage)
            return result
        return wrapper
    _replace(module, name, make)


def _importing(stage: str) -> None:
    """While the command line imports its modules (the last one it imports at start)."""

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "tvmattn.speculative":
                sys.meta_path.remove(Finder)
                ctrl_c(stage)
            return None

    sys.meta_path.insert(0, Finder)


def _scheduling(stage: str) -> None:
    """Inside `tvm.compile`: the first schedule rule dlight tries on a function (Python called by
    a Python pass that TVM's C++ pass manager runs)."""
    from tvmattn.compiler.cpu_matmul import CPUMatmul

    apply = CPUMatmul.apply

    def wrapper(self, *args):
        CPUMatmul.apply = apply
        ctrl_c(stage)
        return apply(self, *args)

    CPUMatmul.apply = wrapper


def _in_step(stage: str, prefill: bool, steps_before: int = 0) -> None:
    """Inside the VM, in layer 1's attention of a step: the prefill (more than one token: the
    commands here answer one prompt) or the decode step after `steps_before` decode steps. The
    layers before it have written their K/V already: the cache is mid-step."""
    import tvm_ffi

    from tvmattn.runtime import ffi  # registers ATTENTION

    original = tvm_ffi.get_global_func(ATTENTION)
    decode_steps = []

    def wrapper(cache, layer_id, sm_scale, qkv, *args):
        if int(layer_id) == 0:
            is_prefill = qkv.shape[0] > 1  # qkv [tokens of the step, heads, head_dim]; one prompt
            if not is_prefill:
                decode_steps.append(1)
            if is_prefill == prefill and (prefill or len(decode_steps) == steps_before + 1):
                wrapper.armed = True
        if int(layer_id) == 1 and getattr(wrapper, "armed", False):
            wrapper.armed = False
            ctrl_c(stage)
        return original(cache, layer_id, sm_scale, qkv, *args)

    del ffi
    tvm_ffi.register_global_func(ATTENTION, wrapper, override=True)


STAGES = {
    "importing": _importing,
    "loading the weights": functools.partial(_before, module="tvmattn.build", name="load_model"),
    "exporting the Relax module": functools.partial(_before, module="tvmattn.models", name="export_module"),
    "scheduling inside tvm.compile": _scheduling,
    "writing the library": functools.partial(_after, module="tvmattn.bundle", name="_write_library"),
    "writing the parameters": functools.partial(_after, module="tvmattn.bundle", name="_write_params"),
    "loading the bundle": functools.partial(_before, module="tvmattn.bundle", name="load_params"),
    "prefill": functools.partial(_in_step, prefill=True),
    "decode": functools.partial(_in_step, prefill=False, steps_before=2),
}


class FakeExecutable:
    """Stands in for the compiler's output: writes a small ELF-looking file."""

    def export_library(self, path: str, **_kwargs) -> None:
        Path(path).write_bytes(b"\x7fELF" + b"\0" * 60)


def run(stage: str, command: list[str], env: dict | None = None, fake_compile: bool = False,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m tvmattn COMMAND` interrupted at `stage` -> its CompletedProcess (text)."""
    assert stage in STAGES, stage
    options = ["--fake-compile"] if fake_compile else []
    return subprocess.run([sys.executable, __file__, *options, stage, *command], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def _main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    fake_compile = argv[:1] == ["--fake-compile"]
    stage, command = argv[fake_compile], argv[fake_compile + 1:]
    if stage != "importing":
        import tvmattn.build  # noqa: F401 - loaded so that its functions can be wrapped
        import tvmattn.generate  # noqa: F401
    if fake_compile:
        import tvmattn.models

        tvmattn.models.compile_module = lambda mod, options: FakeExecutable()
    # a user's Ctrl-C reaches a process whose SIGINT does what Python's default does; a parent
    # that ignores SIGINT (a test runner's worker may) would hand that down through exec
    signal.signal(signal.SIGINT, signal.default_int_handler)
    STAGES[stage](stage)
    sys.argv = ["tvmattn", *command]
    runpy.run_module("tvmattn", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main(sys.argv[1:])

"""compiler.script_frames: inspect.stack() during a build gives every frame, the nearest ones
with their source line, and the original function comes back after the (re-entrant) context;
TVMScript parses inside it as outside (closure variables from the frames)."""

from __future__ import annotations

import inspect

import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvmattn.compiler.script_frames import CONTEXT_FRAMES, cheap_frame_stacks


def _scaled(factor: float):
    @T.prim_func
    def scale(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        for i in range(8):
            b[i] = a[i] * T.float32(factor)

    return scale


def test_frames_match_inspects_and_the_original_returns():
    original = inspect.stack
    expected = [(f.filename, f.function) for f in inspect.stack()]
    callers = [f.lineno for f in inspect.stack()[1:]]
    with cheap_frame_stacks():
        with cheap_frame_stacks():
            frames = inspect.stack()
        assert inspect.stack is not original  # (still inside the outer context)
    assert inspect.stack is original
    assert [(f.filename, f.function) for f in frames] == expected
    assert [f.lineno for f in frames[1:]] == callers
    assert "frames = inspect.stack()" in frames[0].code_context[0]
    assert all(f.code_context is None for f in frames[CONTEXT_FRAMES:])


def test_tvmscript_parses_alike():
    with cheap_frame_stacks():
        inside = _scaled(2.5)
    assert tvm_ffi.structural_equal(inside, _scaled(2.5))
    assert not tvm_ffi.structural_equal(inside, _scaled(3.0))
    assert isinstance(inside, tvm.tirx.PrimFunc)

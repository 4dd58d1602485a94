"""Cheap frame stacks for TVMScript's parser while a library is generated and scheduled.

Every `@T.prim_func` (tvm.tirx.script.parser.entry.prim_func) calls `inspect.stack()`, which
reads a line of source for every frame on the stack; for a frame whose file Python cannot map to
a module (code compiled from strings, as TVMScript's own evaluator makes), `inspect.getmodule`
scans all of `sys.modules`, per frame. dlight's tensor-core Matmul rule and our kernel generators
parse hundreds of prim_funcs under deep stacks, which made that scan most of a CUDA build's time
(docs/performance.md).

`cheap_frame_stacks()` swaps `inspect.stack` for a walk of the frames that gives each frame its
function and line number, and the source line (linecache, no module lookup) for the nearest
CONTEXT_FRAMES frames only: the parser reads the frames themselves (closure variables) and the
code line of frames[2] (whether the function is defined in a class).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import sys
import threading

CONTEXT_FRAMES = 4
_LOCK = threading.Lock()
_DEPTH = [0]


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno) if context and len(frames) < CONTEXT_FRAMES else ""
        frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name,
                                        [line] if line else None, 0 if line else None))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def cheap_frame_stacks():
    """inspect.stack() is `_stack` inside this context (re-entrant; the original is restored when
    the outermost context exits)."""
    with _LOCK:
        if _DEPTH[0] == 0:
            _DEPTH.append(inspect.stack)
            inspect.stack = _stack
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                inspect.stack = _DEPTH.pop()

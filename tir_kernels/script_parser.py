"""TVMScript's macro calls, made to find their parser without reading every frame's source.

A `T.macro` call looks for the active parser in the globals of the frames above it. TVM's
`ScriptMacro._find_parser_def` does so with `inspect.getouterframes`, which also reads the
source lines of every frame and looks each frame's module up among all of `sys.modules`
(thousands once torch is loaded). The kernels call macros hundreds of times while they are
parsed, so that lookup, not the parsing, took most of the time of generating a kernel (and of
exporting a model library, which generates its attention kernels). `install()` replaces it by
the same search, frame by frame, without the source context; `tir_kernels.common` installs it
on import, before any kernel is parsed.
"""

from __future__ import annotations

import sys


def install() -> bool:
    """Replace ScriptMacro._find_parser_def by a frame walk; False where this TVM has none to
    replace (the lookup is then TVM's own)."""
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except ImportError:
        return False
    name = getattr(ScriptMacro, "parser_object_name", None)
    if name is None or not hasattr(ScriptMacro, "_find_parser_def"):
        return False

    def _find_parser_def(self):
        frame = sys._getframe()
        while frame is not None:
            parser = frame.f_globals.get(name)
            if parser is not None:
                return parser
            frame = frame.f_back
        raise RuntimeError(f"{name} not available")

    ScriptMacro._find_parser_def = _find_parser_def
    return True

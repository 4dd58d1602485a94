"""PrimFunc signatures of any length for the quantized kernels (`prim_func`).

TVMScript spells a signature out argument by argument, while a quantized weight arrives as 2 to 5
arrays (config.py) and the CUDA GEMV takes optional arguments besides (residual, the norm's
weight): rather than one hand-written signature per argument count, `prim_func` writes the
function's few lines of source for the arguments given and parses them; the kernel's body stays a
T.macro.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

# a matched argument's type: n_tokens -> match_buffer's (shape, dtype)
MatchSpec = Callable[[tirx.Var], tuple]
_RESERVED = ("T", "func", "n_tokens", "_types", "_body")  # names the generated source uses


def prim_func(params: list[tuple[str, tirx.Buffer | MatchSpec]], body, check_well_formed: bool = True) -> tirx.PrimFunc:
    """The PrimFunc `func(*params)` (attribute tirx.noalias) whose body is the T.macro
    `body(buffers, n_tokens)`.

    params: (name, type) per argument, in order; type a T.Buffer (the argument is that buffer,
    named `name`), or a MatchSpec (the argument is the handle `<name>_h`, and `name` the buffer
    T.match_buffer(<name>_h, *spec(n_tokens)) declares, in argument order). n_tokens: a symbolic
    int64 the function declares where some argument is matched (bound by the first shape that
    holds it), else None. buffers: the arguments' buffers, in order."""
    names = [name for name, _ in params]
    if len(set(names)) != len(names) or not all(name.isidentifier() and name not in _RESERVED for name in names):
        raise ValueError(f"params: expected distinct identifiers other than {_RESERVED} as names, got {names}")
    matched = [not isinstance(kind, tirx.Buffer) for _, kind in params]
    signature = ", ".join(f"{name}_h: T.handle" if match else f"{name}: _types[{i}]"
                          for i, (name, match) in enumerate(zip(names, matched)))
    lines = ["@T.prim_func", f"def func({signature}):", '    T.func_attr({"tirx.noalias": True})']
    if any(matched):
        lines.append("    n_tokens = T.int64()")
        lines += [f"    {name} = T.match_buffer({name}_h, *_types[{i}](n_tokens))"
                  for i, (name, match) in enumerate(zip(names, matched)) if match]
    lines.append(f"    _body([{', '.join(names)}], {'n_tokens' if any(matched) else 'None'})")
    return tvm.script.from_source("\n".join(lines) + "\n", check_well_formed=check_well_formed,
                                  extra_vars={"T": T, "_types": [kind for _, kind in params], "_body": body})

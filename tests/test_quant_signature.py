"""quant.signature.prim_func: the quantized kernels' PrimFunc signature of any argument count.

Each case builds a function that sums its inputs into its last argument and runs it on llvm
against numpy's float64 sum: the arguments arrive in the order given, under the names given,
static buffers and handles matched with the symbolic token count alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tvmattn.quant.signature import prim_func

COLS = 4


def summed(count: int, static: set[int]):
    """The PrimFunc (a0, ..., a{count-1}, y) with y [n_tokens, COLS] = sum_i a_i * (i + 1); the
    inputs at the positions in `static` are T.Buffers of 3 rows, the others (and y) are matched
    to the symbolic n_tokens."""
    def matched(t):
        return (t, T.int64(COLS)), "float32"

    params = [(f"a{i}", T.Buffer((T.int64(3), T.int64(COLS)), "float32") if i in static else matched)
              for i in range(count)]

    def total(bufs, t, j):  # an expression: the weighted sum of the inputs at [t, j]
        out = bufs[0][t, j]
        for i, buf in enumerate(bufs[1:count], start=1):
            out = out + buf[t, j] * T.float32(i + 1)
        return out

    @T.macro
    def body(bufs, n_tokens):
        for t, j in T.grid(n_tokens if n_tokens is not None else T.int64(3), T.int64(COLS)):
            bufs[-1][t, j] = total(bufs, t, j)

    y = matched if len(static) < count else T.Buffer((T.int64(3), T.int64(COLS)), "float32")
    return prim_func(params + [("y", y)], body)


@pytest.mark.parametrize("count,static", [(1, set()), (2, {0}), (7, {1, 4}), (9, set()), (3, {0, 1, 2})],
                         ids=["1-matched", "2-one-static", "7-mixed", "9-matched", "3-static"])
def test_arguments_arrive_in_order_by_name(count, static):
    """Any count: the parameters are named and shaped as given (static buffers of 3 rows, matched
    ones of n_tokens rows), in order; the body sees the buffers in that order (a permutation or a
    dropped argument changes the weighted sum)."""
    func = summed(count, static)
    names = [f"a{i}" for i in range(count)] + ["y"]
    static_y = len(static) == count
    assert [param.name for param in func.params] == names
    rows = ["T.int64(3)" if i in static or (name == "y" and static_y) else "n_tokens" for i, name in enumerate(names)]
    signature = ", ".join(f'{name}: T.Buffer(({r}, T.int64({COLS})), "float32")' for name, r in zip(names, rows))
    assert f"def func({signature}):" in func.script()
    assert func.attrs["tirx.noalias"]

    rng = np.random.default_rng(count)
    inputs = [rng.standard_normal((3, COLS)).astype(np.float32) for _ in range(count)]
    expect = sum(a.astype(np.float64) * (i + 1) for i, a in enumerate(inputs))
    lib = tvm.compile(func.with_attr("global_symbol", "main"), target="llvm")
    out = tvm.runtime.tensor(np.zeros((3, COLS), np.float32))
    lib["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    np.testing.assert_allclose(out.numpy(), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("names", [["x", "x"], ["x", "n_tokens"], ["T", "y"], ["x", "not a name"]])
def test_bad_names_are_refused(names):
    """Names must be distinct identifiers, none of those the generated source itself uses."""
    with pytest.raises(ValueError, match="params: expected distinct identifiers"):
        prim_func([(name, T.Buffer((T.int64(2),), "float32")) for name in names], None)

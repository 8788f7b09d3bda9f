"""Epilogue graphs for smelt.gemm (include/smelt/epilogue.h), built as expressions.

    g = smelt.Epilogue()
    pre = g.acc + g.bias                 # alpha * (a @ b) + bias[n]
    g.store(pre, pre_out)                # keep the pre-activation (any float dtype, [M, N])
    d = g.act("gelu", pre)
    g.row_reduce(d, amax_out, "amax")    # f32 [M]: max over n of |d|
    g.out(d)                             # what D gets
    smelt.gemm(a, b, bias=bias, epilogue=g)

Inputs: g.acc, g.c (beta * c; smelt.gemm's c and beta), g.bias, g.row(t) ([M]),
g.col(t) ([N]), g.aux(t) ([M, N]), g.scalar(v); Python numbers mix in as
scalars. Ops: + - * /, g.max, g.min, g.act(name, x, slope), g.clamp(x, lo, hi),
g.cast(x, dtype). Outputs: g.store(x, t), g.row_reduce(x, t, how),
g.col_reduce(x, t, how) with how 'sum', 'max' or 'amax' (f32 outputs, written
whole), and g.out(x). At most 32 nodes and 8 tensors; the C library checks the
rest. Reductions are deterministic (no float atomics).
"""

# smelt_epi_op, smelt_epi_reduce and smelt_dtype values (smelt/epilogue.h, smelt.h).
_OPS = ("acc", "c", "bias", "row", "col", "aux", "scalar", "add", "sub", "mul", "div", "max", "min", "act", "clamp",
        "cast", "store", "row_reduce", "col_reduce")
_OP = {name: i for i, name in enumerate(_OPS)}
_REDUCE = {"sum": 0, "max": 1, "amax": 2}
_DTYPES = {"f64": 0, "f32": 1, "f16": 2, "bf16": 3, "e4m3": 4, "e5m2": 5}


class Node:
    """A node's value at each element of D; arithmetic builds new nodes."""

    def __init__(self, graph, index):
        self.graph, self.index = graph, index

    def _bin(self, op, other, swap=False):
        other = self.graph._value(other)
        a, b = (other, self) if swap else (self, other)
        return self.graph._add(op, a=a.index, b=b.index)

    def __add__(self, o):
        return self._bin("add", o)

    def __radd__(self, o):
        return self._bin("add", o, True)

    def __sub__(self, o):
        return self._bin("sub", o)

    def __rsub__(self, o):
        return self._bin("sub", o, True)

    def __mul__(self, o):
        return self._bin("mul", o)

    def __rmul__(self, o):
        return self._bin("mul", o, True)

    def __truediv__(self, o):
        return self._bin("div", o)

    def __rtruediv__(self, o):
        return self._bin("div", o, True)


class Epilogue:
    """An epilogue graph for smelt.gemm(..., epilogue=g); see the module doc."""

    def __init__(self):
        self.nodes, self.tensors, self._out = [], [], None
        self.acc = self._add("acc")

    def _add(self, op, a=0, b=0, slot=0, act=0, slope=0.0, value=0.0, lo=0.0, hi=0.0, dtype=0, reduce=0):
        self.nodes.append((_OP[op], a, b, slot, act, slope, value, lo, hi, dtype, reduce))
        return Node(self, len(self.nodes) - 1)

    def _value(self, x):
        return x if isinstance(x, Node) else self.scalar(x)

    def _slot(self, tensor, writable):
        for i, (t, w) in enumerate(self.tensors):
            if t is tensor and w == writable:
                return i
        self.tensors.append((tensor, writable))
        return len(self.tensors) - 1

    @property
    def c(self):
        return self._add("c")

    @property
    def bias(self):
        return self._add("bias")

    def row(self, t):
        return self._add("row", slot=self._slot(t, 0))

    def col(self, t):
        return self._add("col", slot=self._slot(t, 0))

    def aux(self, t):
        return self._add("aux", slot=self._slot(t, 0))

    def scalar(self, v):
        return self._add("scalar", value=float(v))

    def max(self, x, y):
        return self._add("max", a=self._value(x).index, b=self._value(y).index)

    def min(self, x, y):
        return self._add("min", a=self._value(x).index, b=self._value(y).index)

    def act(self, name, x, slope=0.01):
        from . import ACTIVATIONS
        if name not in ACTIVATIONS:
            raise ValueError("smelt.Epilogue.act: %r is not one of %s" % (name, ", ".join(ACTIVATIONS)))
        return self._add("act", a=x.index, act=ACTIVATIONS.index(name),
                         slope=float(slope) if name == "leaky_relu" else 0.0)

    def clamp(self, x, lo, hi):
        return self._add("clamp", a=x.index, lo=float(lo), hi=float(hi))

    def cast(self, x, dtype):
        if dtype not in _DTYPES or dtype == "f64":
            raise ValueError("smelt.Epilogue.cast: %r is not one of f32, f16, bf16, e4m3, e5m2" % (dtype,))
        return self._add("cast", a=x.index, dtype=_DTYPES[dtype])

    def store(self, x, t):
        return self._add("store", a=x.index, slot=self._slot(t, 1))

    def row_reduce(self, x, t, how="sum"):
        return self._add("row_reduce", a=x.index, slot=self._slot(t, 1), reduce=_REDUCE[how])

    def col_reduce(self, x, t, how="sum"):
        return self._add("col_reduce", a=x.index, slot=self._slot(t, 1), reduce=_REDUCE[how])

    def out(self, x):
        self._out = x.index
        return x

    def _args(self):
        """(nodes, out node, slots) as _smelt.gemm_epi takes them."""
        if self._out is None:
            raise ValueError("smelt.Epilogue: call g.out(node) to say what D gets")
        return tuple(self.nodes), self._out, tuple(self.tensors)

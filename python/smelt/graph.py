"""The fusion planner (include/smelt/graph.h) from Python: list ops over
tensors, and smelt groups them into the fewest kernels its fused kernels
allow, plans them once and runs them.

    g = smelt.Graph(device="cpu")
    x, w, b = g.input("x", x_arr), g.input("w", w_arr), g.input("b", b_arr)
    h = g.tensor("h", (M, N), "bf16")          # the graph's own: fused away or workspace
    pre = g.tensor("pre", (M, N), "bf16")
    y = g.output("y", y_arr)
    g.gemm(x, w, h)
    g.bias(h, b, pre)
    g.act("gelu", pre, y)
    g.plan()                                    # fuse=False: one kernel an op
    print(g.describe())                         # which ops went into which kernel, and why
    g.run()                                     # the declared tensors; or g.run(x=x2, y=y2)

Inputs and outputs are DLPack tensors (numpy, torch, ...) whose layout the
graph keeps; a run binds them again by name (the same dtype, shape and
strides; other memory). Ops name tensors by the handles these calls return
or by their names. The rules, shapes and dtypes are the C API's: see
smelt/graph.h and docs/OPS.md ("Fusion planner").
"""

from . import _smelt as _C

__all__ = ["Graph", "GraphTensor"]

_BINOPS = ("add", "sub", "mul", "div", "max", "min")
_MATHS = ("default", "tf32", "3xtf32")
_NORMS = {"rms": 0, "layer": 1}
_LAYOUTS = {"neox": 0, "gptj": 1}


class GraphTensor:
    """A tensor of a smelt.Graph: its name and number."""

    def __init__(self, name, id, kind):
        self.name, self.id, self.kind = name, id, kind

    def __repr__(self):
        return "GraphTensor(%r, %s)" % (self.name, self.kind)


def _choice(value, table, what):
    if value not in table:
        raise _C.ArgumentError("smelt.Graph: %s=%r is not one of %s" % (what, value, ", ".join(map(repr, table))))
    return table.index(value) if isinstance(table, tuple) else table[value]


class Graph:
    """A graph of smelt ops on one context (``device`` or ``ctx`` as for
    every op; None: SMELT_DEVICE when set, else cuda when present, else cpu)."""

    def __init__(self, device=None, *, ctx=None):
        self._g = _C.Graph(ctx if ctx is not None else _C.default_context(device))
        self._tensors = []  # GraphTensor by id
        self._declared = []  # the caller's tensor by id (None for intermediates)

    def _add(self, t, declared):
        self._tensors.append(t)
        self._declared.append(declared)
        return t

    def _id(self, t):
        """A handle's or a name's number; None (an absent optional) is -1."""
        if t is None:
            return -1
        if isinstance(t, GraphTensor):
            return t.id
        for x in self._tensors:
            if x.name == t:
                return x.id
        raise _C.ArgumentError("smelt.Graph: no tensor named %r" % (t,))

    # ---------------------------------------------------------------- tensors

    def input(self, name, tensor):
        """A caller's tensor the graph reads (its layout is kept)."""
        return self._add(GraphTensor(name, self._g.input(name, tensor), "input"), tensor)

    def output(self, name, tensor):
        """A caller's tensor the graph writes."""
        return self._add(GraphTensor(name, self._g.output(name, tensor), "output"), tensor)

    def tensor(self, name, shape, dtype):
        """An intermediate of ``shape`` and smelt dtype name ``dtype`` ('bf16', 'f32', ...)."""
        return self._add(GraphTensor(name, self._g.tensor(name, dtype, tuple(int(s) for s in shape)), "intermediate"),
                         None)

    # ---------------------------------------------------------------- ops (each returns its output)

    def gemm(self, a, b, d, *, alpha=1.0, math="default"):
        """d = alpha · a @ b: a [M, K], b [K, N], d [M, N]."""
        self._g.gemm(self._id(a), self._id(b), self._id(d), float(alpha), _choice(math, _MATHS, "math"))
        return d

    def bias(self, x, bias, y):
        """y = x + bias[n]: x, y [M, N], bias [N]."""
        self._g.bias(self._id(x), self._id(bias), self._id(y))
        return y

    def act(self, name, x, y, slope=0.01):
        """y = act(x), one of smelt.ACTIVATIONS (slope: leaky_relu's)."""
        self._g.act(name, float(slope), self._id(x), self._id(y))
        return y

    def binary(self, op, a, b, y):
        """y = a op b, op one of 'add', 'sub', 'mul', 'div', 'max', 'min'."""
        self._g.binary(_choice(op, _BINOPS, "op"), self._id(a), self._id(b), self._id(y))
        return y

    def add(self, a, b, y):
        return self.binary("add", a, b, y)

    def sub(self, a, b, y):
        return self.binary("sub", a, b, y)

    def mul(self, a, b, y):
        return self.binary("mul", a, b, y)

    def div(self, a, b, y):
        return self.binary("div", a, b, y)

    def max(self, a, b, y):
        return self.binary("max", a, b, y)

    def min(self, a, b, y):
        return self.binary("min", a, b, y)

    def residual_add(self, x, residual, y):
        """y = x + residual (the residual stream)."""
        self._g.residual_add(self._id(x), self._id(residual), self._id(y))
        return y

    def norm(self, kind, x, y, weight=None, bias=None, eps=1e-5):
        """y = norm(x) · weight + bias over the last dim, kind 'rms' or 'layer'."""
        self._g.norm(_choice(kind, _NORMS, "kind"), float(eps), self._id(x), self._id(weight), self._id(bias),
                     self._id(y))
        return y

    def rotary(self, x, cos, sin, y, positions=None, layout="neox", inverse=False):
        """y = RoPE(x): x [B, S, H, D], cos and sin f32 [P, R/2] (smelt.rotary's)."""
        self._g.rotary(_choice(layout, _LAYOUTS, "layout"), int(bool(inverse)), self._id(x), self._id(cos),
                       self._id(sin), self._id(positions), self._id(y))
        return y

    def attention(self, q, k, v, o, *, scale=0.0, causal=False, window=(-1, -1), softcap=0.0):
        """o = attention(q, k, v): q [B, Sq, H, D], k and v [B, Sk, Hk, D] (smelt.attention's)."""
        self._g.attention(float(scale), int(bool(causal)), int(window[0]), int(window[1]), float(softcap),
                          self._id(q), self._id(k), self._id(v), self._id(o))
        return o

    def softmax(self, x, y):
        """y = softmax(x) over the last dim."""
        self._g.softmax(self._id(x), self._id(y))
        return y

    # ---------------------------------------------------------------- plan, run, describe

    def plan(self, fuse=True):
        """Groups the ops into kernels (fuse=False: one an op) and plans them."""
        self._g.plan(0 if fuse else 1)

    def run(self, *, stream=None, **tensors):
        """Runs the plan on the declared tensors, or on those given by name."""
        names = {t.name for t in self._tensors if t.kind != "intermediate"}
        for n in tensors:
            if n not in names:
                raise _C.ArgumentError("smelt.Graph.run: no input or output named %r" % (n,))
        bind = tuple(None if t.kind == "intermediate" else tensors.get(t.name, self._declared[t.id])
                     for t in self._tensors)
        outputs = tuple(t.kind == "output" for t in self._tensors)
        self._g.run(bind, outputs, stream)

    def describe(self):
        """The plan in words: each kernel's ops, and why the rest did not fuse."""
        return self._g.describe()

    def stats(self):
        """ops, tensors, kernels, fused_away (intermediates never materialized), workspace_bytes."""
        return self._g.stats()

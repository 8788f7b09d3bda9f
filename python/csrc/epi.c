/* A GEMM with an epilogue graph from Python: _smelt.gemm_epi(a, b, c, bias,
 * out, alpha, beta, math, ctx, stream, nodes, out_node, slots), which
 * smelt.gemm calls when given an epilogue (smelt/epilogue.py builds it).
 *
 *   nodes     the graph's nodes in order, each (op, a, b, slot, act, slope,
 *             value, lo, hi, dtype, reduce): smelt_epi_node's fields, enums
 *             as their values
 *   out_node  the node D gets
 *   slots     (tensor, writable) pairs, the graph's slot tensors in order
 *   out       D, allocated by the caller
 * Returns out. The plan is made per call (plan, run, destroy): the graph
 * is not part of the binding's plan key, and its kernel comes from the
 * context's module table after the first call. */
#include "smelt_py.h"
#include "smelt/gemm.h"

#include <stdio.h>

static int parse_nodes(PyObject *nodes, int out_node, smelt_epi_graph *g) {
  *g = smelt_epi_graph_empty();
  if (!PyTuple_Check(nodes) || PyTuple_Size(nodes) > SMELT_EPI_MAX_NODES) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.gemm: the epilogue has more than %d nodes", SMELT_EPI_MAX_NODES);
    return -1;
  }
  g->count = (int)PyTuple_Size(nodes);
  g->out = out_node;
  for (int i = 0; i < g->count; i++) {
    smelt_epi_node *n = &g->node[i];
    int op, act, dtype, reduce;
    float slope, value, lo, hi;
    if (!PyArg_ParseTuple(PyTuple_GetItem(nodes, i), "iiiiiffffii:epilogue node", &op, &n->a, &n->b, &n->slot, &act,
                          &slope, &value, &lo, &hi, &dtype, &reduce))
      return -1;
    n->op = (smelt_epi_op)op;
    n->act = (smelt_act)act;
    n->slope = slope;
    n->value = value;
    n->lo = lo;
    n->hi = hi;
    n->dtype = (smelt_dtype)dtype;
    n->reduce = (smelt_epi_reduce)reduce;
  }
  return 0;
}

static PyObject *py_gemm_epi(PyObject *self, PyObject *args) {
  PyObject *ao, *bo, *co, *biaso, *outo, *math, *ctx, *stream, *nodes, *slots;
  double alpha, beta;
  int out_node;
  (void)self;
  if (!PyArg_ParseTuple(args, "OOOOOddOOOOiO:gemm_epi", &ao, &bo, &co, &biaso, &outo, &alpha, &beta, &math, &ctx,
                        &stream, &nodes, &out_node, &slots))
    return NULL;
  smelt_epi_graph g;
  if (parse_nodes(nodes, out_node, &g) < 0) return NULL;
  if (!PyTuple_Check(slots) || PyTuple_Size(slots) > SMELT_EPI_MAX_TENSORS) {
    smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.gemm: the epilogue names more than %d tensors",
               SMELT_EPI_MAX_TENSORS);
    return NULL;
  }
  smelt_gemm_desc d = smelt_gemm_desc_default();
  d.epilogue.alpha = alpha;
  d.epilogue.beta = beta;
  d.epilogue.graph = &g;
  static const char *const maths[] = {"default", "tf32", "3xtf32"};
  int mi = -1;
  for (int i = 0; i < 3 && PyUnicode_Check(math); i++)
    if (!PyUnicode_CompareWithASCIIString(math, maths[i])) mi = i;
  if (mi < 0) return smpy_raise(SMELT_STATUS_INVALID_ARGUMENT, "smelt.gemm: math is not 'default', 'tf32' or '3xtf32'");
  d.math.op = (smelt_gemm_math_op)mi;
  smpy_call call;
  PyObject *result = NULL;
  smelt_tensor *a, *b, *c = NULL, *bias = NULL, *out;
  smelt_epi_tensors epi = {(int)PyTuple_Size(slots), {NULL}};
  if (smpy_call_begin(&call, "smelt.gemm", ctx, stream) < 0) return NULL;
  if (smpy_call_import(&call, ao, "a", 0, &a) < 0 || smpy_call_import(&call, bo, "b", 0, &b) < 0 ||
      (co != Py_None && smpy_call_import(&call, co, "c", 0, &c) < 0) ||
      (biaso != Py_None && smpy_call_import(&call, biaso, "bias", 0, &bias) < 0) ||
      smpy_call_import(&call, outo, "out", 1, &out) < 0)
    goto done;
  for (int s = 0; s < epi.count; s++) {
    PyObject *pair = PyTuple_GetItem(slots, s), *t;
    int writable;
    smelt_tensor *ts;
    char name[48];
    snprintf(name, sizeof name, "epilogue tensor %d", s);
    if (!PyArg_ParseTuple(pair, "Op:epilogue slot", &t, &writable) ||
        smpy_call_import(&call, t, name, writable, &ts) < 0)
      goto done;
    epi.t[s] = ts;
  }
  smpy_ctx *cx = call.ctx;
  const int cpu = smelt_ctx_device(cx->ctx) == SMELT_DEVICE_CPU;
  smpy_ctx_lock(cx);
  smelt_status s = smpy_ctx_use_stream(cx, call.stream);
  if (!s) {
    PyThreadState *ts = cpu ? PyEval_SaveThread() : NULL;
    s = smelt_gemm_epi(cx->ctx, &d, a, b, c, out, bias, NULL, &epi);
    if (ts) PyEval_RestoreThread(ts);
  }
  smpy_ctx_unlock(cx);
  if (s) {
    smpy_raise_status(s);
    goto done;
  }
  Py_INCREF(outo);
  result = outo;
done:
  smpy_call_end(&call);
  return result;
}

PyMethodDef smpy_epi_methods[] = {
    {"gemm_epi", py_gemm_epi, METH_VARARGS,
     "gemm_epi(a, b, c, bias, out, alpha, beta, math, ctx, stream, nodes, out_node, slots) -> out"},
    {NULL, NULL, 0, NULL}};

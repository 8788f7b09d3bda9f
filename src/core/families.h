/* The op families, one line each, in the order the tests, `smelt bench` and
 * `smelt demo` list them. F(name): a family on the op-family interface
 * (src/core/internal.h: smelt__family_<name>, smelt__cpu_<name>,
 * smelt__cuda_<name>, smelt__<name>_variants), which may also have
 * th_tests_<name>, cli_bench_<name> and cli_demo_<name>. This header holds
 * nothing else, so the tests and the CLI can read the list without the
 * library's internals. */
#ifndef SMELT_FAMILIES_H
#define SMELT_FAMILIES_H

#define SMELT__FAMILY_LIST(F)                                                                                    \
  F(activation) F(softmax) F(topk) F(gemm) F(conv2d) F(attention) F(attention_decode) F(kv_cache_append) F(peer)  \
  F(moe) F(bem) F(quant) F(dequant) F(norm) F(norm_bwd) F(residual) F(rotary) F(qgemm)

#endif /* SMELT_FAMILIES_H */

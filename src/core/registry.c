/* The op registry: every op family's variant enumerator (what precompile and
 * the compile test walk), the embedded kernel sources, and the prelude builder. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

const smelt__variant_enum_fn smelt__variant_enums[] = {
    smelt__activation_variants,
    smelt__softmax_variants,
    smelt__topk_variants,
    smelt__gemm_variants,
    smelt__attention_variants,
    smelt__peer_variants,
};
const int smelt__variant_enum_count = (int)(sizeof smelt__variant_enums / sizeof smelt__variant_enums[0]);

const smelt__embedded_file *smelt__embedded_find(const char *name) {
  for (int i = 0; i < smelt__embedded_count; i++)
    if (!strcmp(smelt__embedded_files[i].name, name)) return &smelt__embedded_files[i];
  return NULL;
}

void smelt__prelude_define(smelt__kernel_src *src, const char *name, long long value) {
  size_t used = strlen(src->prelude);
  snprintf(src->prelude + used, sizeof src->prelude - used, "#define %s %lld\n", name, value);
}

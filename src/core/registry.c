/* The op registry: the families on the op-family interface, every family's
 * variant enumerator (what precompile and the compile test walk), the
 * embedded kernel sources, and the prelude builder. Both lists come from
 * src/core/families.h. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#define FAMILY_ADDR(name) &smelt__family_##name,
const smelt__family *const smelt__families[] = {SMELT__FAMILY_LIST(FAMILY_ADDR)};
const int smelt__family_count = (int)(sizeof smelt__families / sizeof smelt__families[0]);

#define VARIANTS(name) smelt__##name##_variants,
const smelt__variant_enum_fn smelt__variant_enums[] = {SMELT__FAMILY_LIST(VARIANTS)};
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

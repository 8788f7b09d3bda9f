/* Option parsing for every command, driven by tables of cli_opt so that the
 * parser and the --help text come from one description and never disagree.
 * Only long options exist (plus -h), in GNU style: "--name value" or
 * "--name=value". Sizes take binary suffixes because the things measured
 * (buffers, rows) are naturally powers of two. */
#include "cli.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static const cli_opt *find_opt(const cli_opt *const *tables, const char *name, size_t len) {
  for (; *tables; tables++)
    for (const cli_opt *o = *tables; o->name; o++)
      if (strlen(o->name) == len && strncmp(o->name, name, len) == 0) return o;
  return NULL;
}

/* Decimal integer with an optional k/M/G suffix (x 2^10, 2^20, 2^30). */
static int parse_int(const char *s, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (end == s || errno != 0) return -1;
  int shift = 0;
  switch (*end) {
  case 'k': case 'K': shift = 10; end++; break;
  case 'm': case 'M': shift = 20; end++; break;
  case 'g': case 'G': shift = 30; end++; break;
  default: break;
  }
  if (*end != '\0') return -1;
  if (v > (INT64_MAX >> shift) || v < -(INT64_MAX >> shift)) return -1;
  *out = (int64_t)v * ((int64_t)1 << shift);
  return 0;
}

static void add_list_items(const cli_doc *doc, const cli_opt *o, const char *value) {
  cli_list *list = o->value;
  const char *p = value;
  while (*p) {
    size_t len = strcspn(p, ",");
    if (len > 0) {
      if (list->n == CLI_LIST_MAX)
        cli_usage_error(doc->command, "--%s: at most %d values", o->name, CLI_LIST_MAX);
      if (len >= sizeof list->item[0])
        cli_usage_error(doc->command, "--%s: value '%.*s' is too long", o->name, (int)len, p);
      memcpy(list->item[list->n], p, len);
      list->item[list->n][len] = '\0';
      list->n++;
    }
    p += len;
    if (*p == ',') p++;
  }
}

static void set_value(const cli_doc *doc, const cli_opt *o, const char *value) {
  switch (o->kind) {
  case CLI_OPT_FLAG:
    *(int *)o->value = 1;
    break;
  case CLI_OPT_INT:
    if (parse_int(value, o->value) != 0)
      cli_usage_error(doc->command, "--%s: '%s' is not an integer (suffixes k, M, G allowed)",
                      o->name, value);
    break;
  case CLI_OPT_STRING:
    *(const char **)o->value = value;
    break;
  case CLI_OPT_LIST:
    add_list_items(doc, o, value);
    break;
  }
}

int cli_parse(const cli_doc *doc, int argc, char **argv, const cli_opt *const *tables) {
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
      cli_print_help(stdout, doc, tables);
      return 1;
    }
    if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
      cli_usage_error(doc->command, "unexpected argument '%s'", arg);
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    const cli_opt *o = find_opt(tables, name, len);
    if (!o) cli_usage_error(doc->command, "unknown option '--%.*s'", (int)len, name);
    if (o->kind == CLI_OPT_FLAG) {
      if (eq) cli_usage_error(doc->command, "--%s takes no value", o->name);
      set_value(doc, o, NULL);
      continue;
    }
    const char *value = eq ? eq + 1 : NULL;
    if (!value) {
      if (i + 1 >= argc) cli_usage_error(doc->command, "--%s needs a value", o->name);
      value = argv[++i];
    }
    set_value(doc, o, value);
  }
  return 0;
}

/* Help lines put descriptions in one column; longer option names push the
 * description to the next line rather than breaking the column. */
enum { HELP_COLUMN = 28 };

static void print_opt_line(FILE *f, const char *left, const char *help) {
  int w = fprintf(f, "  %s", left);
  if (w + 2 > HELP_COLUMN) {
    fprintf(f, "\n");
    w = 0;
  }
  fprintf(f, "%*s%s\n", HELP_COLUMN - w, "", help);
}

void cli_print_help(FILE *f, const cli_doc *doc, const cli_opt *const *tables) {
  fprintf(f, "usage: %s\n\n%s\noptions:\n", doc->usage, doc->about);
  char left[96];
  for (; *tables; tables++)
    for (const cli_opt *o = *tables; o->name; o++) {
      if (o->metavar)
        snprintf(left, sizeof left, "--%s %s", o->name, o->metavar);
      else
        snprintf(left, sizeof left, "--%s", o->name);
      print_opt_line(f, left, o->help);
    }
  print_opt_line(f, "-h, --help", "show this help and exit");
}

int64_t cli_require_range(const cli_doc *doc, const char *name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    cli_usage_error(doc->command, "--%s %lld is out of range [%lld, %lld]", name, (long long)v,
                    (long long)lo, (long long)hi);
  return v;
}

smelt_dtype cli_require_dtype(const cli_doc *doc, const char *name, const char *value,
                              const smelt_dtype *allowed, int n) {
  smelt_dtype dt;
  if (smelt_dtype_from_name(value, &dt) == SMELT_OK)
    for (int i = 0; i < n; i++)
      if (allowed[i] == dt) return dt;
  char set[128] = "";
  for (int i = 0; i < n; i++) {
    strncat(set, i ? ", " : "", sizeof set - strlen(set) - 1);
    strncat(set, smelt_dtype_name(allowed[i]), sizeof set - strlen(set) - 1);
  }
  cli_usage_error(doc->command, "--%s '%s' is not one of: %s", name, value, set);
}

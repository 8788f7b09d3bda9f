/* Formatting shared by the commands: human-readable sizes for the text
 * output and strict JSON for --json, which scripts parse line by line. */
#include "cli.h"

#include <math.h>

const char *cli_fmt_bytes(uint64_t bytes, char *buf, size_t n) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, n, "%llu B", (unsigned long long)bytes);
  else
    snprintf(buf, n, "%.1f %s", v, units[u]);
  return buf;
}

void cli_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      fprintf(f, "\\%c", c);
    else if (c < 0x20)
      fprintf(f, "\\u%04x", c);
    else
      fputc(c, f);
  }
  fputc('"', f);
}

void cli_json_number(FILE *f, double v) {
  if (isfinite(v))
    fprintf(f, "%.6g", v);
  else
    fputs("null", f);
}

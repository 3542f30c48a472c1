#!/usr/bin/env bash
# Issue #40 at scale: benchmarks/bench.py on a bigger machine than the 2-core development VM.
#
#   benchmarks/device_bench.sh [--no-pure-python] SIZE...
#   e.g. OUT=/tmp/out benchmarks/device_bench.sh 1000000 5000000
#
# Meant for the lent device machine (python3 there has torch, pandas, numpy, matplotlib, a C
# compiler, no network): it names the machine, builds snaplab's C extensions in place, checks
# that they are the ones in use, then runs bench.py with `python -m torch.cuda._memory_viz` from
# the same python3 and, unless --no-pure-python, snaplab's pure-Python path beside it. Everything
# printed goes to $OUT/ as it comes (a command stopped at its time limit still leaves its log).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/device_bench_out}
mkdir -p "$OUT"
pure=(--pure-python)
if [[ ${1:-} == --no-pure-python ]]; then pure=(); shift; fi
(($#)) || { echo "usage: $0 [--no-pure-python] SIZE..." >&2; exit 2; }
log="$OUT/bench_$(IFS=_; echo "$*").log"

# 1. the machine
{
  echo "== machine ($(date -u +%FT%TZ))"
  uname -srm
  grep -m1 PRETTY_NAME /etc/os-release 2>/dev/null || true
  echo "nproc: $(nproc)"
  free -g 2>/dev/null || grep -E 'MemTotal|MemAvailable' /proc/meminfo
  lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|Thread|Socket|MHz' || grep -m1 'model name' /proc/cpuinfo
  df -h /tmp | tail -n 1
  cc --version | head -n 1
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "pandas", "numpy", "matplotlib", "jinja2", "typer", "rich", "setuptools"):
    try:
        print(f"  {name} {importlib.import_module(name).__version__}")
    except Exception as exc:  # noqa: BLE001 - report whatever is missing and go on
        print(f"  {name}: {exc!r}")
EOF
} 2>&1 | tee "$OUT/machine.txt"

# 2. the C extensions, in place (no network: no pip, no build isolation); the build's own
#    output goes to its log, only failures are shown
echo "== build_ext --inplace" | tee "$OUT/build.log"
if ! "$PY" setup.py -q build_ext --inplace >>"$OUT/build.log" 2>&1; then
  echo "setup.py build_ext failed (see build.log); compiling each extension with cc" | tee -a "$OUT/build.log"
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  flags=$("$PY" -c 'import sysconfig as s; print(s.get_config_var("CFLAGS") or "-O2", s.get_config_var("CCSHARED") or "-fPIC")')
  for c in snapshot_lab/frames/_scan.c snapshot_lab/load/_decode.c snapshot_lab/metrics/allocator/_replay.c; do
    # shellcheck disable=SC2086  # the flags are words
    cc $flags -shared -I"$inc" "$c" -o "${c%.c}$suffix" 2>&1 | tee -a "$OUT/build.log" || true
  done
fi
# 3. is the compiled code the one in use? (bench.py prints the same line beside the machine)
env -u SNAPLAB_PURE_PYTHON "$PY" -c 'from snapshot_lab import _compiled; print("snaplab:", _compiled.describe())' \
  | tee -a "$OUT/build.log"
grep -q 'snaplab: compiled (C)' "$OUT/build.log" || echo "WARNING: the C extensions are NOT all in use" | tee -a "$OUT/build.log"

# bench.py takes peak RSS and CPU time from GNU time; where /usr/bin/time is missing, put there
# a stand-in that writes the same "%M %U %S" line (wait4's rusage: the same numbers GNU time reads)
if [[ ! -x /usr/bin/time ]]; then
  echo "no /usr/bin/time: building a wait4 stand-in" | tee -a "$OUT/build.log"
  cat >/tmp/rusage_time.c <<'EOF'
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
/* time -f FORMAT -o FILE CMD...: runs CMD, writes "maxrss_KiB user_s sys_s" to FILE (FORMAT ignored) */
int main(int argc, char **argv) {
  const char *path = NULL; int i = 1;
  for (; i < argc && argv[i][0] == '-'; i += 2) if (!strcmp(argv[i], "-o")) path = argv[i + 1];
  pid_t pid = fork();
  if (pid == 0) { execvp(argv[i], argv + i); perror("exec"); _exit(127); }
  int status; struct rusage ru; wait4(pid, &status, 0, &ru);
  FILE *f = path ? fopen(path, "w") : stderr;
  fprintf(f, "%ld %.2f %.2f\n", ru.ru_maxrss, ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6,
          ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6);
  if (path) fclose(f);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
EOF
  cc -O2 -o /usr/bin/time /tmp/rusage_time.c
fi

# 4. the benchmark: each size's snapshot is generated, timed against, and deleted in turn
cmd=("$PY" benchmarks/bench.py --sizes "$@" --torch-python "$PY" "${pure[@]}" --workdir /tmp/bench)
echo "== ${cmd[*]}" | tee "$log"
"${cmd[@]}" 2>&1 | tee -a "$log"

#!/usr/bin/env bash
# System-wide CPU profile of one benchmark run.
#
#   profile.sh OUT -- COMMAND [ARGS...]       record, then report
#   profile.sh OUT --report [REPORT OPTIONS]  report again (e.g. one phase's window)
#
# Records `perf record -a -g -F $FREQ -k mono` (every core, so idle shows as
# `swapper`) while COMMAND runs, and writes COMMAND's output to OUT.log with each
# line prefixed by CLOCK_MONOTONIC seconds, the clock of the samples' timestamps,
# so a phase's window can be read off the log. Then prints, via report.py:
#   (a) samples per process (all threads and pids of one name together) as a share
#       of all samples, idle included, and CPU-ms (and CPU-µs per op with --ops N);
#   (b) samples per process per second (a timeline, to find phase boundaries);
#   (c) the top symbols (self time) of the top processes.
# Report options: --from T --to T, or --window T:T (repeatable), in monotonic
# seconds as in OUT.log; --ops N (operations in the window),
# --top-procs K (3), --top-syms S (15), --bin SECONDS (1), --thread-syms (symbols
# per thread name too), --inclusive REGEX (inclusive shares of those symbols, e.g.
# 'XLogFlush|fdatasync|CommitTransactionCommand'; needs frame pointers, as
# PostgreSQL has and our release build does not).
# Example, one phase of a recorded run:
#   flock /tmp/bench.lock profile.sh /tmp/i.data -- oncely-bench intake --seconds 6 --rounds 1
#   profile.sh /tmp/i.data --report --window 9672.8:9678.4 --ops 9360 --thread-syms
# Env: FREQ (199). Needs root (perf_event_paranoid 2). Run benchmarks under
# `flock /tmp/bench.lock` with compilers stopped; see docs/profiles.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: profile.sh OUT -- COMMAND... | profile.sh OUT --report [opts]}; shift
case "${1:-}" in
  --report) shift; exec python3 "$here/report.py" "$out" "$@" ;;
  --) shift ;;
  *) echo "usage: profile.sh OUT -- COMMAND..." >&2; exit 2 ;;
esac
stamp='import sys,time
for l in sys.stdin: print(f"{time.monotonic():.3f} {l}", end="", flush=True)'
set +e
perf record -a -g -F "${FREQ:-199}" -k mono -o "$out" -- \
  bash -c 'set -o pipefail; "$@" 2>&1 | python3 -u -c "$0"' "$stamp" "$@" > "$out.log"
rc=$?
set -e
cat "$out.log"
python3 "$here/report.py" "$out"
exit $rc

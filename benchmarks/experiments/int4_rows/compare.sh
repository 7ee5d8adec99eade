#!/bin/bash
# Alternate benchmarks/experiments/int4/int4_profile.py on two (bundle, libspecedge_ops) pairs, twice each, and print
# each run's T = 1, 2, 5 step medians, T5/T1 and the load average before it. Run under the bench lock:
#   flock /tmp/specedge-bench.lock benchmarks/experiments/int4_rows/compare.sh \
#       OLD_BUNDLE OLD_LIB NEW_BUNDLE NEW_LIB OUT_DIR [--cpu-clock]
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: $0 OLD_BUNDLE OLD_LIB NEW_BUNDLE NEW_LIB OUT_DIR [--cpu-clock]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
mkdir -p "$5"
for rep in 1 2; do
  for v in old new; do
    if [ $v = old ]; then b=$1 lib=$2; else b=$3 lib=$4; fi
    out="$5/${v}_${rep}${6:-}.json"
    echo "== $v rep $rep load $(cut -d' ' -f1-3 /proc/loadavg)"
    SPECEDGE_OPS_LIB=$lib python "$repo/benchmarks/experiments/int4/int4_profile.py" "$b" --rounds 5 ${6:-} > "$out" 2>/dev/null
    python -c "import json,sys;d=json.load(open(sys.argv[1]));print({k:v['specedge_ms'] for k,v in d['steps'].items()},'T5/T1',d['T5_over_T1'])" "$out"
  done
done

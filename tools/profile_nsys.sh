#!/usr/bin/env bash
# Profile a few replayed guided decode steps (tools/profile_cupti.py's workload: a guided
# capgraph.generate with the capturable decoder in CUDA graphs) so that capgraph's NVTX ranges
# (domain "capgraph"), the host node and the mask kernel show on one timeline.
#
#   bash tools/profile_nsys.sh [profile_cupti.py options...]    e.g.  --batch 64 --steps 8
#
# With Nsight Systems (nsys on PATH, or NSYS=/path/to/nsys) that makes a report: CUDA API,
# kernels with graph nodes traced one by one, OS runtime and the capgraph NVTX domain, and
# prints its NVTX, kernel and API summaries. Without nsys, or when nsys makes no report (the
# GPU image's copy inside Nsight Compute writes a .qdstrm it cannot turn into a report), it
# runs tools/profile_cupti.py, the CUPTI trace of the same steps, instead.
#
# Environment: PYTHON (default python3), OUT (output folder, default ./nsys-out), NSYS.
# Output: $OUT/capgraph_replay.nsys-rep and capgraph_replay_stats.txt (nsys), or
# $OUT/profile_cupti.json and profile_cupti.txt (CUPTI). Where there is no CUDA device the
# fallback says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/nsys-out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
NSYS=${NSYS:-$(command -v nsys || true)}

cupti_fallback() {  # cupti_fallback WHY [options...]: the CUPTI trace of the same workload
  echo "profile_nsys.sh: $1; tracing with CUPTI (tools/profile_cupti.py) instead"
  shift
  "$PY" tools/profile_cupti.py --json "$OUT/profile_cupti.json" "$@" | tee "$OUT/profile_cupti.txt"
  return "${PIPESTATUS[0]}"
}

if [ -z "$NSYS" ]; then
  cupti_fallback "nsys (Nsight Systems) is not installed here" "$@"
  exit $?
fi

REPORT=$OUT/capgraph_replay
ARGS=(profile --trace=cuda,nvtx,osrt --nvtx-domain-include=capgraph
      --output="$REPORT" --force-overwrite=true)
# graph replays as individual nodes, where supported
if "$NSYS" profile --help 2>/dev/null | grep -q -- "--cuda-graph-trace"; then
  ARGS+=(--cuda-graph-trace=node)
fi
echo "profile_nsys.sh: $NSYS ${ARGS[*]} $PY tools/profile_cupti.py --tracer none $*"
"$NSYS" "${ARGS[@]}" "$PY" tools/profile_cupti.py --tracer none "$@"
rc=$?
if [ $rc -ne 0 ]; then
  echo "profile_nsys.sh: the profiled workload exited with status $rc" >&2
  exit $rc
fi
if [ ! -f "$REPORT.nsys-rep" ]; then
  cupti_fallback "nsys wrote no report at $REPORT.nsys-rep" "$@"
  exit $?
fi
"$NSYS" stats --force-export=true --report nvtx_sum,cuda_gpu_kern_sum,cuda_api_sum \
  "$REPORT.nsys-rep" | tee "${REPORT}_stats.txt"
echo "profile_nsys.sh: report $REPORT.nsys-rep"

#!/usr/bin/env bash
# Profile `capgraph demo` under Nsight Systems: CUDA API and kernels, OS runtime, and the NVTX
# ranges of the "capgraph" domain (every decoder stage: add_batch, build, copy, apply, ...).
#
#   bash tools/profile_nsys.sh [demo options...]      e.g.  --drafter ngram --decoder capturable
#
# Environment: PYTHON (default python3), OUT (report directory, default ./nsys-out), DEVICE
# (default cuda when nvidia-smi sees a GPU, else cpu). Without nsys it says so and exits 0.
# The report is $OUT/capgraph_demo.nsys-rep; a summary of NVTX ranges and CUDA kernels is
# printed and saved as $OUT/capgraph_demo_stats.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nsys >/dev/null 2>&1; then
  echo "profile_nsys.sh: nsys (Nsight Systems) is not installed here; nothing profiled."
  echo "  Install Nsight Systems (CUDA toolkit or https://developer.nvidia.com/nsight-systems)"
  echo "  and rerun; 'capgraph demo' itself runs without it."
  exit 0
fi

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/nsys-out}
mkdir -p "$OUT"
if [ -z "${DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEVICE=cuda
  else
    DEVICE=cpu
  fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

REPORT=$OUT/capgraph_demo
ARGS=(profile --trace=cuda,nvtx,osrt --nvtx-domain-include=capgraph
      --output="$REPORT" --force-overwrite=true)
# graph replays as individual nodes (the host-callback nodes included), where supported
if nsys profile --help 2>/dev/null | grep -q -- "--cuda-graph-trace"; then
  ARGS+=(--cuda-graph-trace=node)
fi

echo "profile_nsys.sh: nsys ${ARGS[*]} $PY -m capgraph.cli demo --device $DEVICE $*"
nsys "${ARGS[@]}" "$PY" -m capgraph.cli demo --device "$DEVICE" "$@"
rc=$?
if [ $rc -ne 0 ]; then
  echo "profile_nsys.sh: the profiled demo exited with status $rc" >&2
  exit $rc
fi
if [ -f "$REPORT.nsys-rep" ]; then
  nsys stats --force-export=true --report nvtx_sum,cuda_gpu_kern_sum "$REPORT.nsys-rep" \
    | tee "${REPORT}_stats.txt"
  echo "profile_nsys.sh: report $REPORT.nsys-rep"
else
  echo "profile_nsys.sh: nsys wrote no report at $REPORT.nsys-rep" >&2
  exit 1
fi

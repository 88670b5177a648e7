#!/usr/bin/env bash
# The one script a lent GPU machine runs: build the CUDA kernel, run every GPU test (marker
# "gpu"), run the GPU benchmarks and the profile, and print a short table last.
#
# Here first:   PYTHON=.venv/bin/python bash tools/prepare_gpu_run.sh
# Then, once:   device run  command="bash tools/gpu_check.sh"  carry=[".whl", ".gpu-cache"]
#               timeout_s=595 (the steps' time boxes add up to 550 s; the rest is the wheel
#               install, the version lines and the report)
# Logs and JSON land in $OUT (the device tool brings them back) or ./gpu-check-out; the
# Markdown tables and target verdicts (tools/gpu_report.py) are printed and kept in report.md.
#
# Time boxes (seconds; each step is stopped with SIGINT at its box, so what it wrote stays):
#   kernel          30  NVRTC compile and load of csrc/logits_bitmask.cu; the C++ host build
#                       library and hostfunc's lane compiled here, not inside a test's box
#   gpu-tests      150  pytest -m gpu on the open issues' files: native host node, pipelined
#                       steps, native host functions, draft trees, grammar drafts, capturable decoder,
#                       runtime, advance_batch
#   gpu-tests-rest  60  pytest -m gpu on every other file (the op and kernel tests among them)
#   bench-kernel    25  tools/bench_kernel.py: the mask kernel's rmw, ahead and store variants
#                       (timed in turn on the same inputs) against xgrammar's Triton kernel,
#                       ours given a token mask as the decoder always gives one
#   bench-apply     15  capgraph bench apply on CUDA
#   bench-hostfunc  10  tools/bench_hostfunc.py: eager and replayed host nodes
#   guided-host     20  tools/bench_guided_host.py: the host time generate()'s guide driver adds
#                       to a replayed step, on CUDA (batch 8, 64, 256)
#   bench-argmax    20  tools/bench_argmax.py: greedy sampling under a bitmask, the fused
#                       masked argmax against mask-then-argmax and argmax alone, batch 1-256
#   bench-replay    80  tools/bench_graph_replay.py: guided/unguided replayed step at tiny 64,
#                       256 and small 8, 64, 256, per host-node kind (python, native), and at
#                       tiny 64 and 256 the native node with its batch made before the launch
#                       (native-before) and with the logits masked, then argmaxed, instead of
#                       the fused masked argmax (native-unfused)
#   breakdown       25  tools/bench_graph_replay.py --breakdown, native node, tiny 64 and 256:
#                       the guided host work's parts (take_failed, the drain hooks, the node
#                       records' read, advance_batch) and, guided and unguided, the engine's
#                       decode step and the graph's launch call, in wall and CPU us per step
#   bench-loop      45  capgraph bench loop on CUDA, batch 8 first and last (importing
#                       transformers' Llama alone takes over 15 s on the GPU image)
#   fill-threads    25  tools/bench_fill_threads.py: the native fill pool's crossover, 1-16
#                       threads at batch 8-256, 30 steps (the automatic choice spends its
#                       first five steps starting and measuring both sides)
#   profile         25  tools/profile_nsys.sh: nsys, else the CUPTI trace of replayed steps
#   xgr-cuda        20  bench_kernel.py with xgrammar's CUDA kernel (if its build finished),
#                       the three variants again, without a token mask (like for like)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/capgraph-site .whl/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/capgraph-site:$PWD
else
  export PYTHONPATH=$PWD
fi
[ -d .gpu-cache ] && export CAPGRAPH_CACHE_DIR=$PWD/.gpu-cache
LOG=$OUT/gpu_check.log
: > "$LOG"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

run() {  # run NAME SECONDS CMD...: time-boxed, logged, summarised; never aborts the script
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$LOG"
  # SIGINT first (pytest still writes its junit XML and summary, the benchmarks keep the JSON
  # written so far), SIGKILL 15 s later if that did not end it
  timeout -s INT -k 15 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  printf '%-16s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$SUMMARY"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
"$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$LOG"
# the versions that decide which code paths run (the image's, or the carried wheels')
"$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|tokenizers|cuda-core|cuda-bindings|cuda-python|nvidia-cuda-nvrtc|nvidia-cuda-cupti|cupti-python|triton|xgrammar|llguidance|apache-tvm-ffi) " | tee -a "$LOG"

# a per-test limit (pytest-timeout, carried as a wheel), so that one test that hangs in Python
# cannot eat the rest of its box: the CUDA paths of the open issues have never run
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=60)

# xgrammar's CUDA kernel is a torch extension that nvcc builds on first use (over a minute): it
# builds in the background, for this GPU's architecture alone, while the tests run, and the
# last step compares against it if the build has finished by then. MAX_JOBS=2 keeps ninja off
# most of the 16 cores while bench-hostfunc and bench-replay time host work.
XGR_BUILD_LOG=$OUT/xgr_cuda_build.log
# The architecture list is exported for the whole script: torch keys its extension cache on the
# build flags, so the benchmark's import must see the same list or it builds again.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c \
  "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)}
( MAX_JOBS=2 timeout -k 5 240 "$PY" -c \
    "import xgrammar.kernels.apply_token_bitmask_inplace_cuda; print('xgrammar CUDA kernel built')"
  echo "xgrammar CUDA build rc=$?" ) > "$XGR_BUILD_LOG" 2>&1 &
XGR_BUILD=$!

# Time boxes add up to 550 s (the header lists them). Each step writes its results as it goes.
run kernel 30 "$PY" -c "
from capgraph.ops.cuda import load_kernel
k = load_kernel(); assert k is not None, 'no kernel'; print('kernel compiled and loaded')
from capgraph.build import library
print('host build library:', library.unavailable_reason() or 'compiled and loaded')
from hostfunc.lane import lane_library
lane_library(); print('hostfunc lane compiled and loaded')"
# the open issues' GPU tests in a box of their own (native host node, pipelined steps, native
# host functions, draft trees, grammar drafts against greedy, the graph-replayed decoder and
# drafts in the runtime), then
# every other file in another, so that neither can cut the other
FIRST=(tests/test_host_node_gpu.py tests/test_pipelined_steps.py tests/test_hostfunc_native_gpu.py
       tests/test_draft_trees_gpu.py tests/test_grammar_drafts.py
       tests/test_capturable_gpu.py tests/test_runtime.py tests/test_advance_batch.py)
REST=()
for f in tests/test_*.py; do
  case " ${FIRST[*]} " in *" $f "*) ;; *) REST+=("$f") ;; esac
done
run gpu-tests 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs ${PER_TEST[@]+"${PER_TEST[@]}"} \
    "${FIRST[@]}" --junitxml="$OUT/gpu_tests.xml"
run gpu-tests-rest 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
    ${PER_TEST[@]+"${PER_TEST[@]}"} "${REST[@]}" --junitxml="$OUT/gpu_tests_rest.xml"
# (the decoder's call: with a token mask, which rmw reads before its bitmask and logits)
[ -f tools/bench_kernel.py ] && run bench-kernel 25 "$PY" tools/bench_kernel.py \
    --no-xgrammar-cuda --token-mask --repeat 20 --json "$OUT/bench_kernel.json"
run bench-apply 15 "$PY" -m capgraph.bench apply --no-cpu --no-xgrammar-cuda \
    --json "$OUT/bench_apply.json"
run bench-hostfunc 10 "$PY" tools/bench_hostfunc.py
[ -f tools/bench_guided_host.py ] && run guided-host 20 "$PY" tools/bench_guided_host.py \
    --device cuda --batches 8 64 256 --blocks 4 --json "$OUT/guided_host.json"
# greedy sampling under the mask: fused against mask-then-argmax, kernel times alone
[ -f tools/bench_argmax.py ] && run bench-argmax 20 "$PY" tools/bench_argmax.py \
    --batches 1 16 64 256 --patterns 2% 98% --json "$OUT/bench_argmax.json"
# the host-bound points first, so a run cut by its box keeps the ones the issue is about
run bench-replay 80 "$PY" tools/bench_graph_replay.py --host-node both \
    --points tiny:64,tiny:256,small:8,small:64,small:256 --json "$OUT/bench_replay.json"
# where the tiny model's guided host work goes, part by part (wall and CPU us per step)
run breakdown 25 "$PY" tools/bench_graph_replay.py --host-node native --points tiny:64,tiny:256 \
    --before-points "" --breakdown --json "$OUT/replay_breakdown.json"
# batch 8 measured first and again last: the two must agree (the warm-up defect check)
run bench-loop 45 "$PY" -m capgraph.bench loop --device cuda --batches 8 1 8 --steps 30 \
    --json "$OUT/bench_loop.json"
# the native fill's crossover on this machine's cores (the 2-core figures are in BENCHMARKS)
[ -f tools/bench_fill_threads.py ] && run fill-threads 25 "$PY" tools/bench_fill_threads.py \
    --batches 8 32 64 256 --threads 1 2 4 8 16 --steps 30 \
    --json "$OUT/bench_fill_threads.json"
# nsys where the image has a working one, else CUPTI (profile_cupti.json, profile_cupti.txt)
run profile 25 env PYTHON="$PY" OUT="$OUT" bash tools/profile_nsys.sh --model tiny --batch 64 \
    --steps 8 --max-lines 250
if kill -0 "$XGR_BUILD" 2>/dev/null; then
  echo "xgrammar's CUDA build still running: its comparison is skipped" | tee -a "$LOG"
  # (a background subshell ignores SIGINT: stop its timeout, which stops the build)
  pkill -TERM -P "$XGR_BUILD" 2>/dev/null; kill -TERM "$XGR_BUILD" 2>/dev/null
else
  cat "$XGR_BUILD_LOG" >> "$LOG"
  [ -f tools/bench_kernel.py ] && grep -q "kernel built" "$XGR_BUILD_LOG" && run xgr-cuda 20 \
      "$PY" tools/bench_kernel.py --dtypes bf16 --patterns random,dense --batches 1,64,1024,4096 \
      --repeat 20 --json "$OUT/bench_kernel_xgr_cuda.json"
fi

echo
echo "---- report (Markdown for docs/BENCHMARKS.md; also in report.md) ----"
"$PY" tools/gpu_report.py "$OUT" | tee "$OUT/report.md"
echo
echo "---- tails ----"
grep -E "passed|failed|error" "$LOG" | tail -n 5
grep -E "breakdown, us per step" "$LOG" | tail -n 4
echo
echo "---- gpu_check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) ----"
cat "$SUMMARY"

# The device tool brings back at most 8 files from $OUT: every result file goes into one
# archive beside the log, the summary and the report (unpack it and run tools/gpu_report.py on
# the folder to remake the report).
keep="gpu_check.log|summary.txt|report.md|gpu_check_results.tar.gz"
(cd "$OUT" && files=$(ls | grep -vxE "$keep") && [ -n "$files" ] && tar -czf gpu_check_results.tar.gz $files && rm -f $files \
  && echo "results archived in $OUT/gpu_check_results.tar.gz: $(echo $files)")

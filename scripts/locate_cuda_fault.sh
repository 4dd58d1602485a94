#!/usr/bin/env bash
# Locate the CUDA fault of `bench_e2e.py --model scripts/gemma3-270m-config.json --prompt-len 4096
# --no-cuda-graph` (issue 37) on the GPU machine, from the project root:
#
#   . .device/env.sh && bash scripts/locate_cuda_fault.sh [--order 16,64,1] [--libraries tvmattn,tvm]
#
# Needs the project tree and .device/env.sh (full TVM: carry .device/site.tar.xz on a fresh machine).
# Libraries: bench_e2e.py's build/e2e/gemma3-270m-config-{tvmattn,tvm}.so; missing ones are built
# first (a few minutes: carry build/e2e from an earlier run to skip that). Logs go to $OUT
# (or /tmp/locate-cuda-fault).
# 1. scripts/locate_cuda_fault.py with CUDA_LAUNCH_BLOCKING=1: bench_e2e.py's calls in its order,
#    each decode step synchronized; prints the phase (library, batch, step) of the fault, the
#    launch's error (grid/block) and the Python frames of the launch.
# 2. If compute-sanitizer is on the machine: memcheck over that library and batch alone (or, when
#    step 1 saw no fault, over a short plain bench_e2e.py run): the faulting kernel's name, the
#    access and the address.
# 3. Without a fault in step 1: the plain bench_e2e.py run (asynchronous launches), to tell a fault
#    that needs kernels in flight (a race) from one that is gone.
set -u
cd "$(dirname "$0")/.."
if [ -z "${PYTHONPATH:-}" ] && [ -f .device/env.sh ]; then . .device/env.sh; fi
OUT="${OUT:-/tmp/locate-cuda-fault}"
mkdir -p "$OUT"
MODEL=scripts/gemma3-270m-config.json
ORDER=1,16,64
LIBS=tvmattn,tvm
while [ $# -gt 0 ]; do
  case "$1" in
    --order) ORDER="$2"; shift 2 ;;
    --libraries) LIBS="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    *) echo "error: unknown argument $1 (expected --order, --libraries, --model)"; exit 2 ;;
  esac
done
COMMON=(--model "$MODEL" --prompt-len 4096)

echo "== 1. synchronous launches (CUDA_LAUNCH_BLOCKING=1), order $ORDER, libraries $LIBS"
CUDA_LAUNCH_BLOCKING=1 timeout 420 python3 scripts/locate_cuda_fault.py "${COMMON[@]}" --order "$ORDER" \
  --libraries "$LIBS" --steps 4 --reps 1 > "$OUT/locate.log" 2>&1
status=$?
grep -v "^phase:" "$OUT/locate.log" | tail -n 40
grep "^phase:" "$OUT/locate.log" | tail -n 3
FAULT=$(grep -m1 "^FAULT:" "$OUT/locate.log" || true)

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer \
      2>/dev/null | head -n 1 || true)
if [ -z "$SAN" ]; then
  SAN=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site
for root in site.getsitepackages() + ["/usr/local", "/opt"]:
    for path in glob.glob(os.path.join(root, "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            print(path); raise SystemExit
EOF
  )
fi

if [ -n "$FAULT" ]; then
  # "FAULT: <library> batch <B>: ..." -> that library and batch alone under memcheck
  LIB=$(echo "$FAULT" | sed -n 's/^FAULT: \([a-z]*\) batch \([0-9]*\).*/\1/p')
  BATCH=$(echo "$FAULT" | sed -n 's/^FAULT: \([a-z]*\) batch \([0-9]*\).*/\2/p')
  echo "== step 1 fault: $FAULT (exit status $status)"
  if [ -n "$SAN" ] && [ -n "$LIB" ]; then
    echo "== 2. $SAN memcheck: library $LIB, batch $BATCH"
    timeout 420 "$SAN" --tool memcheck --print-limit 4 --show-backtrace device --report-api-errors no \
      python3 scripts/locate_cuda_fault.py "${COMMON[@]}" --order "$BATCH" --libraries "$LIB" --steps 2 --reps 0 \
      > "$OUT/memcheck.log" 2>&1
    grep -E "^=========" "$OUT/memcheck.log" | grep -vE "^========= *$" | head -n 40
    grep -E "^FAULT|^no fault" "$OUT/memcheck.log"
  elif [ -n "$SAN" ]; then
    echo "== 2. $SAN memcheck: the fault came before the decode phases: order $ORDER, libraries $LIBS"
    timeout 420 "$SAN" --tool memcheck --print-limit 4 --show-backtrace device --report-api-errors no \
      python3 scripts/locate_cuda_fault.py "${COMMON[@]}" --order "$ORDER" --libraries "$LIBS" --steps 2 --reps 1 \
      > "$OUT/memcheck.log" 2>&1
    grep -E "^=========" "$OUT/memcheck.log" | grep -vE "^========= *$" | head -n 40
    grep -E "^FAULT|^no fault" "$OUT/memcheck.log"
  else
    echo "== 2. no compute-sanitizer on this machine: the grid/block and frames above name the launch"
  fi
else
  echo "== step 1: no fault with synchronous launches (exit status $status)"
  echo "== 3. plain bench_e2e.py (asynchronous launches), 4 steps, 1 rep"
  timeout 420 python3 scripts/bench_e2e.py "${COMMON[@]}" --no-cuda-graph --steps 4 --reps 1 \
    > "$OUT/bench.log" 2>&1
  echo "bench_e2e.py exit status $?"
  grep -E "Error|error|FAILED" "$OUT/bench.log" | head -n 10
  if [ -n "$SAN" ]; then
    echo "== 2. $SAN memcheck over the plain bench_e2e.py run"
    timeout 420 "$SAN" --tool memcheck --print-limit 4 --show-backtrace device --report-api-errors no \
      python3 scripts/bench_e2e.py "${COMMON[@]}" --no-cuda-graph --steps 4 --reps 1 > "$OUT/memcheck.log" 2>&1
    grep -E "^=========" "$OUT/memcheck.log" | grep -vE "^========= *$" | head -n 40
  fi
fi
echo "logs: $OUT"

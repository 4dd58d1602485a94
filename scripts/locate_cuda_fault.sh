#!/usr/bin/env bash
# Locate the CUDA fault of `bench_e2e.py --model scripts/gemma3-270m-config.json --prompt-len 4096
# --no-cuda-graph` (issue 37) on the GPU machine, from the project root:
#
#   . .device/env.sh && bash scripts/locate_cuda_fault.sh [--order 1,16,64] [--libraries tvmattn,tvm]
#
# Needs the project tree and .device/env.sh (full TVM: carry .device/site.tar.xz on a fresh machine).
# Libraries: bench_e2e.py's build/e2e/gemma3-270m-config-{tvmattn,tvm}.so; missing ones are built
# first (carry build/e2e from an earlier run to skip that). Logs go to $OUT
# (or /tmp/locate-cuda-fault); each stage prints its FAULT line (library, batch, step) or "no fault".
# 1. --sync launch: every launch synchronous (CUDA_LAUNCH_BLOCKING=1), a sync after each step: the
#    launch that reports the fault is the faulting one (its grid/block and Python frames).
# 2. Only if 1 saw no fault (the fault needs work in flight): --sync step (async launches, a sync
#    after each step), then --sync none (bench_e2e.py's pace: the host runs ahead of the GPU) for
#    each library alone: which library, and whether a step must overlap the one before.
# 3. If compute-sanitizer is on the machine: memcheck over the first faulting library, batch and
#    mode alone (24 steps: past the page boundary at 4,112 tokens): the faulting kernel's name, the
#    access and the address.
# Each stage stops after 7 minutes (timeout 420).
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
# bench_e2e.py's 3 warm-up + 64 timed steps: the 4,096-token sequences cross a page boundary (4,112)
# in its timed steps, and windows slide past page boundaries every 16 steps
STEPS=67

# run NAME SYNC LIBRARIES ORDER STEPS REPS: one driver run, its log $OUT/NAME.log, its summary printed
run() {
  local name=$1 sync=$2 libs=$3 order=$4 steps=$5 reps=$6
  echo "== $name: --sync $sync, libraries $libs, order $order, $steps steps"
  timeout 420 python3 scripts/locate_cuda_fault.py "${COMMON[@]}" --sync "$sync" --libraries "$libs" \
    --order "$order" --steps "$steps" --reps "$reps" > "$OUT/$name.log" 2>&1
  echo "   exit status $?"
  grep -E "^(FAULT|no fault|error)|CUDA|grid=|^  [a-z].*:[0-9]+ " "$OUT/$name.log" | head -n 30
  if ! grep -qE "^(FAULT|no fault)" "$OUT/$name.log"; then tail -n 15 "$OUT/$name.log"; fi
}

FOUND=""  # "sync libs batch" of the first fault
note_fault() {  # note_fault NAME SYNC: FOUND from the FAULT line of $OUT/NAME.log
  local line lib batch
  line=$(grep -m1 "^FAULT:" "$OUT/$1.log" || true)
  [ -n "$line" ] && [ -z "$FOUND" ] || return 0
  lib=$(echo "$line" | sed -n 's/^FAULT: \([a-z]*\) batch \([0-9]*\).*/\1/p')
  batch=$(echo "$line" | sed -n 's/^FAULT: \([a-z]*\) batch \([0-9]*\).*/\2/p')
  FOUND="$2 ${lib:-$LIBS} ${batch:-$ORDER}"
}

run launch launch "$LIBS" "$ORDER" "$STEPS" 1
note_fault launch launch
if [ -z "$FOUND" ]; then
  run step step "$LIBS" "$ORDER" "$STEPS" 1
  note_fault step step
  for lib in ${LIBS//,/ }; do
    run "none-$lib" none "$lib" "$ORDER" "$STEPS" 1
    note_fault "none-$lib" none
  done
fi

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
if [ -z "$FOUND" ]; then
  echo "== no fault in any mode"
elif [ -z "$SAN" ]; then
  echo "== first fault: --sync/libraries/batch $FOUND; no compute-sanitizer on this machine"
else
  read -r sync lib batch <<< "$FOUND"
  echo "== memcheck ($SAN): --sync $sync, libraries $lib, order $batch"
  timeout 420 "$SAN" --tool memcheck --print-limit 4 --show-backtrace device --report-api-errors no \
    python3 scripts/locate_cuda_fault.py "${COMMON[@]}" --sync "$sync" --libraries "$lib" --order "$batch" \
    --steps 24 --reps 0 > "$OUT/memcheck.log" 2>&1
  echo "   exit status $?"
  grep -E "^=========" "$OUT/memcheck.log" | grep -vE "^========= *$" | head -n 40
  grep -E "^(FAULT|no fault)" "$OUT/memcheck.log"
fi
echo "logs: $OUT"

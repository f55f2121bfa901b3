#!/usr/bin/env bash
# The CUDA path's checks and measurements in one run, on a machine with an NVIDIA GPU:
#
#   bash bench/cuda_suite.sh OUTDIR [STAGE ...]      stages: build check tests perf bench
#                                                     (default: all, in that order)
#   build   ggml-cuda into $GGML_PREFIX (unless it already holds one) and ott-gguf against
#           it (bench/build_cuda.sh)
#   check   ott-cuda-ops check: kernels vs the CPU reference
#   tests   pytest tests/test_cuda.py and the quantized-cache tests on the GPU
#   perf    ott-cuda-ops perf: copy bandwidth and attention kernel bandwidth
#   bench   bench/cuda_bench.py: decode throughput, f16 vs ott2, on a 7B-shaped model
#   profile Nsight Compute on the first kernel matching PROFILE_KERNEL (a regex, default
#           attn_partial; kvq_attn for KVQuant's) of each PROFILE context:batch (default
#           16384:64 8192:8): stall cycles per issued instruction by reason, instructions,
#           active warps, DRAM and SM throughput (needs ncu on PATH; the GPU's clocks are
#           left as they are)
#
# Environment: GGML_PREFIX (default build/ggml-cuda), MODEL (the 7B-shaped GGUF, default
# /tmp/llama7b-random.gguf, written when missing), CONTEXTS (default 4096,16384),
# PYTEST_K (a pytest -k expression), PYTEST_FILES (more test files or node ids), PYTEST_ARGS
# (e.g. "-n 8": pytest-xdist's workers; one process takes over 200 s on an H200 machine),
# PROFILE, PROFILE_KERNEL, and those of bench/build_cuda.sh. Each stage's output goes to
# OUTDIR/<stage>.txt; a stage's failure is recorded and the next one runs.
set -uo pipefail

OUTDIR="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
STAGES=("${@:-build check tests perf bench}")
read -r -a STAGES <<< "${STAGES[*]}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
GGML_PREFIX="${GGML_PREFIX:-$REPO/build/ggml-cuda}"
MODEL="${MODEL:-/tmp/llama7b-random.gguf}"
CONTEXTS="${CONTEXTS:-4096,16384}"
export PYTHONUNBUFFERED=1
T0=$(date +%s)

note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUTDIR/suite.txt"; }
# python without the checkout on sys.path, so that the installed package is the one imported
py() { (cd "$OUTDIR" && python3 "$@"); }
ops_path() { echo "$(py -c 'import ott_gguf._native as n, os; print(os.path.dirname(n._mod.__file__))')/ott-cuda-ops"; }
ops() { "$(ops_path)" "$@"; }

for stage in "${STAGES[@]}"; do
  note "stage $stage"
  case "$stage" in
    build)
      if [[ -f "$GGML_PREFIX/include/ggml-cuda.h" ]]; then
        ggml_DIR="$(dirname "$(find "$GGML_PREFIX" -name ggml-config.cmake -print -quit)")"
        python3 -m pip install --no-build-isolation ${PIP_ARGS:-} "$REPO" -Cbuild-dir="$REPO/build/cuda-{wheel_tag}" \
          -Ccmake.define.OTT_CUDA=ON -Ccmake.define.ggml_DIR="$ggml_DIR" \
          -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80;86;89;90}" > "$OUTDIR/build.txt" 2>&1
      else
        bash "$REPO/bench/build_cuda.sh" "$GGML_PREFIX" > "$OUTDIR/build.txt" 2>&1
      fi ;;
    check) ops check > "$OUTDIR/check.txt" 2>&1 ;;
    tests)
      k_args=()
      [[ -n "${PYTEST_K:-}" ]] && k_args=(-k "$PYTEST_K")
      # shellcheck disable=SC2086
      (cd "$REPO" && python3 -P -m pytest -q -rP -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_cuda.py \
        tests/test_kv_native.py ${PYTEST_FILES:-} "${k_args[@]}") > "$OUTDIR/tests.txt" 2>&1 ;;
    perf) ops perf ${CONTEXTS//,/ } 8192 > "$OUTDIR/perf.txt" 2>&1 ;;
    bench) py "$REPO/bench/cuda_bench.py" --model "$MODEL" --contexts "$CONTEXTS" --skip-kernels \
             --json "$OUTDIR/bench.json" > "$OUTDIR/bench.txt" 2>&1 ;;
    profile)
      for cb in ${PROFILE:-16384:64 8192:8}; do
        echo "== $cb"
        ncu --clock-control none \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__warps_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed" \
          -k "regex:${PROFILE_KERNEL:-attn_partial}" -c 1 "$(ops_path)" perf "$cb" 2>&1 | grep -v '^==PROF==\|^{'
      done > "$OUTDIR/profile.txt" 2>&1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  note "stage $stage: exit $?"
done

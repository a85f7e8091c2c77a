#!/usr/bin/env bash
# sanitize.sh - compute-sanitizer over the GPU code, on a machine with a GPU: memcheck (out of
# bounds and misaligned accesses) and racecheck (shared-memory hazards) over test_gpt's GPU tests
# of kernels, of the model and of FP8, and every version of the dev/ kernel ladders, at their check
# shapes.
#
#   bash scripts/sanitize.sh [SECONDS]     each run's time limit (default 200)
#
# The runs go at once (the sanitizer's cost is mostly the host's, and the checks are small), each
# under its own time limit; a table at the end gives each run's tool, target, error count and
# verdict. racecheck covers the kernel, FP8 and dev checks only: the model tests run every kernel
# again at larger shapes, which racecheck would take many times the time limit over. Logs go
# to $OUT (default /tmp/sanitize) as sanitize_logs.tgz, with the table in sanitize.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${1:-200}
OUT=${OUT:-/tmp/sanitize}
logs=$(mktemp -d)
mkdir -p "$OUT"

# the NCCL of the pip wheel when the system has none (the Makefile links -lnccl)
if ! ldconfig -p | grep -q libnccl.so; then
    nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
    [ -n "$nccl" ] && ln -sf "$nccl"/libnccl.so.* "$nccl/libnccl.so" 2>/dev/null
    export LIBRARY_PATH="$nccl:${LIBRARY_PATH:-}" LD_LIBRARY_PATH="$nccl:${LD_LIBRARY_PATH:-}"
fi
make -j"$(nproc)" train_gpt test_gpt dev 2>&1 | grep -E "error|undefined" | head -20
[ -x test_gpt ] && [ -x dev/attention ] || { echo "sanitize: the build failed" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$logs/gpu.txt"

# name | tool | command
runs=(
    "memcheck_kernel_tests|memcheck|./test_gpt gpu_kernel"
    "memcheck_model_tests|memcheck|./test_gpt gpu_model"
    "memcheck_fp8_tests|memcheck|./test_gpt gpu_fp8"
    "racecheck_kernel_tests|racecheck|./test_gpt gpu_kernel"
    "racecheck_fp8_tests|racecheck|./test_gpt gpu_fp8"
)
for v in 1 2 3 4; do
    runs+=("memcheck_attention_v$v|memcheck|./dev/attention $v check")
    runs+=("racecheck_attention_v$v|racecheck|./dev/attention $v check")
done
pids=()
for r in "${runs[@]}"; do
    IFS='|' read -r name tool cmd <<<"$r"
    # shellcheck disable=SC2086
    timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 99 $cmd >"$logs/$name.log" 2>&1 &
    pids+=($!)
done
status=0
printf "%-26s %-10s %-34s %-8s %s\n" run tool command exit result | tee "$logs/sanitize.txt"
for i in "${!runs[@]}"; do
    IFS='|' read -r name tool cmd <<<"${runs[$i]}"
    wait "${pids[$i]}"
    code=$?
    summary=$(grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$name.log" | tail -n 1)
    tests=$(grep -hE "^[0-9]+ passed, [0-9]+ failed" "$logs/$name.log" | tail -n 1)
    case $code in
        0) result="clean: ${summary:-no summary} ${tests:+($tests)}" ;;
        124) result="TIMED OUT after $limit s ${summary}"; status=1 ;;
        *) result="FOUND: ${summary:-exit $code} ${tests:+($tests)}"; status=1 ;;
    esac
    printf "%-26s %-10s %-34s %-8s %s\n" "$name" "$tool" "$cmd" "$code" "$result" | tee -a "$logs/sanitize.txt"
done
cp "$logs/sanitize.txt" "$OUT/"
tar -czf "$OUT/sanitize_logs.tgz" -C "$logs" .
exit $status

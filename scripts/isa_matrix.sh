#!/usr/bin/env bash
# Run pytest under every CPU kernel set ATen can pick on this machine and 1 and 2 OpenMP threads.
#
# torch's CPU kernels (and so the order of fp32 sums) differ by ISA: ATEN_CPU_CAPABILITY forces the
# kernel set (default = no SIMD dispatch, avx2, avx512 where the CPU has AVX512F/BW/VL/DQ), and
# OMP_NUM_THREADS changes how reductions are split. A test whose tolerance holds on only one of
# these combinations is tuned to one machine; this script shows it.
#
#   scripts/isa_matrix.sh                          # the default suite, 4 or 6 runs
#   scripts/isa_matrix.sh tests/test_reference.py  # any pytest arguments
#   ISA_MATRIX_ISAS="avx2 avx512" scripts/isa_matrix.sh   # a subset of the kernel sets
#
# Prints one line per combination (the capability torch really used, pytest's summary) and exits
# non-zero if any run failed. Full logs go to $ISA_MATRIX_LOGS (default: a fresh temporary folder).
set -u
cd "$(dirname "$0")/.."
logs=${ISA_MATRIX_LOGS:-$(mktemp -d -t isa-matrix.XXXXXX)}
mkdir -p "$logs"
echo "logs: $logs"

isas="default avx2"
if grep -q avx512f /proc/cpuinfo 2>/dev/null && grep -q avx512bw /proc/cpuinfo && grep -q avx512vl /proc/cpuinfo \
    && grep -q avx512dq /proc/cpuinfo; then
    isas="$isas avx512"
fi
isas=${ISA_MATRIX_ISAS:-$isas}  # e.g. ISA_MATRIX_ISAS="avx2 avx512" to rerun a subset

status=0
printf '%-8s %-7s %-9s %s\n' ISA threads torch_uses result
for isa in $isas; do
    for threads in 1 2; do
        log="$logs/pytest-$isa-$threads.log"
        used=$(ATEN_CPU_CAPABILITY=$isa python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
        ATEN_CPU_CAPABILITY=$isa OMP_NUM_THREADS=$threads python -m pytest -p no:cacheprovider "$@" >"$log" 2>&1
        rc=$?
        [ $rc -ne 0 ] && status=1
        summary=$(grep -E '(passed|failed|error|no tests ran)' "$log" | tail -1)
        printf '%-8s %-7s %-9s rc=%d  %s\n' "$isa" "$threads" "$used" "$rc" "$summary"
    done
done
exit $status

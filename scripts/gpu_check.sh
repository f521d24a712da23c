#!/usr/bin/env bash
# One command for a Linux machine with an NVIDIA GPU and nothing installed: set up, run the tests
# marked `cuda`, measure pinned vs pageable host-to-device bandwidth, run the stream benchmark with
# every layer streamed from pinned RAM, profile the machine for --tree auto (the profiler's CUDA path),
# and print one summary. Meant to finish within 10 minutes.
# Results also go to $OUT (default: ./gpu_check_out). Needs python3-venv and network access to PyPI
# for the CUDA build of torch (about 2.5 GB) on the first run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
start=$(date +%s)
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "setup"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi)"; exit 2
fi
# A venv of its own: a .venv copied from a CPU machine would hold a CPU build of torch.
timeout 420 bash scripts/setup_env.sh .venv-gpu > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 2; }
PY=.venv-gpu/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/torch.txt" || exit 2

step "cuda tests"
timeout 180 $PY -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}

step "host-to-device bandwidth"
timeout 60 $PY benchmarks/h2d_bandwidth.py --mib 1024 --json "$OUT/h2d.json" 2>&1 | tee "$OUT/h2d.txt"

step "stream benchmark (RAM tier, cuda)"
timeout 180 $PY benchmarks/stream_bench.py --device cuda --offload ram --widths 1,16,64,128,256 --repeats 5 --no-peer \
    --json "$OUT/stream_ram_cuda.json" 2>&1 | tee "$OUT/stream_ram_cuda.txt"
bench_rc=${PIPESTATUS[0]}

step "profile (cuda, RAM tier, self-int8 draft): the CUDA path of the profiler"
timeout 120 $PY -m offload_engine profile --device cuda --offload ram --draft self-int8 --budget-s 60 \
    --out "$OUT/profile_cuda.json" 2>&1 | tail -30 | tee "$OUT/profile_cuda.txt"
profile_rc=${PIPESTATUS[0]}

step "summary"
{
    echo "torch/GPU: $(cat "$OUT/torch.txt")"
    echo "cuda tests: $(tail -1 "$OUT/pytest_cuda.txt") (exit $tests_rc)"
    echo "bandwidth: $(tail -1 "$OUT/h2d.txt")"
    echo "profile (cuda): exit $profile_rc; $(grep -m1 streaming "$OUT/profile_cuda.txt")"
    echo "stream benchmark exit $bench_rc:"
    grep '^|' "$OUT/stream_ram_cuda.txt" || true
    echo "total: $(( $(date +%s) - start )) s"
} | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

#!/usr/bin/env bash
# The device check: one command on a Linux machine with an NVIDIA GPU, meant to finish within 8
# minutes, that needs no network when the machine's python3 already has CUDA torch:
#   tests   the tests marked `cuda` (streaming, self-drafts, attention backends, graphed draft
#           levels, device-side selection and verification: greedy tokens and chi-square)
#   h2d     pinned vs pageable host-to-device bandwidth
#   folders random-weight checkpoints of real shapes made on the GPU (6 Llama-2-70B-shaped target
#           layers, a 16-layer Llama-3-8B-shaped draft; 320- and 128,256-token vocabularies)
#   stream  the stream benchmark on the 70B-shaped target, every layer from pinned RAM
#   quant   the same 6 layers streamed as q4_0 blocks (dequantized by the fused kernels on the
#           copy stream) against bf16, in one run: bytes, pass time, stall and dequant time
#   step    the step benchmark (benchmarks/gpu_step.py): target pass, draft levels, the rest of the
#           step, for trees (16,6) .. (512,20), greedy and T=0.6, a profiled step, the issue-17 bar,
#           and issue 23's: the (128,12) step with the next tree grown during the pass
#   quick   the step benchmark's --quick: (128,12) only, both temperatures, the small vocabulary
#           (the issue-17 and issue-23 bars there, in about a minute)
# Run some stages alone, in the order named, with STAGES="quick tests" scripts/gpu_check.sh (a
# stage that needs the folders makes them first). Results go to $OUT
# (default ./gpu_check_out); the folders to $WORK (default /tmp/sequoia_gpu_check, about 30 GB).
# Python: the machine's python3 when it has CUDA torch (the repo on PYTHONPATH), with any wheels
# found in .whl/ installed beside it (a machine without the `gguf` package: `pip download --no-deps
# -d .whl gguf` where an index is reachable, and carry .whl); otherwise a venv of its own, set up
# only when a package index is reachable.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
WORK="${WORK:-/tmp/sequoia_gpu_check}"
STAGES="${STAGES:-tests h2d folders stream quant step}"
DEADLINE="${DEADLINE:-420}"  # seconds: a stage that would start later is skipped (and says so)
mkdir -p "$OUT" "$WORK"
start=$(date +%s)
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
has() {  # run the stage: asked for, and not past the deadline
    want "$1" || return 1
    if [ $(( $(date +%s) - start )) -gt "$DEADLINE" ]; then echo "== $1: skipped, past the ${DEADLINE} s deadline"; return 1; fi
}
export PYTHONUNBUFFERED=1
export XDG_CACHE_HOME="$WORK/cache"  # packed layer stores (10 GB each) beside the folders, not in ~/.cache

step "setup"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi)"; exit 2
fi
if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "using $(command -v python3) (CUDA torch already installed)"
    if compgen -G ".whl/*.whl" >/dev/null; then  # wheels carried in for what that python3 lacks (gguf)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
            && export PYTHONPATH="$PYTHONPATH:$WORK/site" && echo "installed into $WORK/site: $(ls .whl)"
    fi
elif python3 -m pip download --no-deps -q -d "$WORK/probe" pip >/dev/null 2>&1; then
    echo "no CUDA torch in python3; a package index is reachable: setting up .venv-gpu"
    timeout 420 bash scripts/setup_env.sh .venv-gpu > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 2; }
    PY=.venv-gpu/bin/python
else
    echo "gpu_check: python3 has no CUDA torch and no package index is reachable to install one"; exit 2
fi
$PY - <<'EOF' 2>&1 | tee "$OUT/torch.txt" || exit 2
import importlib, torch
missing = [m for m in ("safetensors", "tokenizers", "jinja2", "tqdm", "psutil", "scipy", "transformers", "pytest", "gguf")
           if importlib.util.find_spec(m) is None]
assert not missing, f"missing Python packages: {', '.join(missing)}"
assert torch.cuda.is_available(), "torch sees no GPU"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
EOF
tests_rc=0; stream_rc=0; step_rc=0; quant_rc=0; quick_rc=0
folders_made=0

run_stage() {
    case "$1" in
    tests)
        step "cuda tests"
        timeout "${TESTS_TIMEOUT:-240}" $PY -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.txt"
        tests_rc=${PIPESTATUS[0]} ;;
    h2d)
        step "host-to-device bandwidth"
        timeout 60 $PY benchmarks/h2d_bandwidth.py --mib 1024 --json "$OUT/h2d.json" 2>&1 | tee "$OUT/h2d.txt" ;;
    folders)
        [ "$folders_made" -eq 1 ] && return
        step "random-weight checkpoints of real shapes (made on the GPU)"
        timeout 150 $PY benchmarks/gpu_step.py --make-only --work "$WORK" 2>&1 | tee "$OUT/folders.txt"
        folders_made=1 ;;
    stream)
        run_stage folders
        step "stream benchmark (6 layers of 70B shape, every layer from pinned RAM)"
        timeout 120 $PY benchmarks/stream_bench.py --target "$WORK/target-v320" --device cuda --offload ram \
            --widths 1,16,64,256,1024 --repeats 3 --no-peer --json "$OUT/stream_ram_cuda.json" 2>&1 | tee "$OUT/stream_ram_cuda.txt"
        stream_rc=${PIPESTATUS[0]} ;;
    quant)
        run_stage folders
        step "quantized streaming (the 6 layers as q4_0 blocks against bf16, from pinned RAM)"
        timeout 180 $PY benchmarks/stream_bench.py --target "$WORK/target-v320" --device cuda --offload ram \
            --weights bf16,q4_0 --widths 1,16,64 --repeats 3 --prefix 128 --json "$OUT/stream_quant_cuda.json" \
            2>&1 | tee "$OUT/stream_quant_cuda.txt"
        quant_rc=${PIPESTATUS[0]} ;;
    quick)
        run_stage folders
        step "step benchmark, quick: (128,12) at both temperatures, the small vocabulary"
        timeout 180 $PY benchmarks/gpu_step.py --quick --work "$WORK" --json "$OUT/gpu_step_quick.json" 2>&1 | tee "$OUT/gpu_step_quick.txt"
        quick_rc=${PIPESTATUS[0]} ;;
    step)
        run_stage folders
        step "step benchmark"
        timeout 240 $PY benchmarks/gpu_step.py --work "$WORK" --json "$OUT/gpu_step.json" 2>&1 | tee "$OUT/gpu_step.txt"
        step_rc=${PIPESTATUS[0]}
        cp "$WORK"/profile_step_v*.txt "$OUT"/ 2>/dev/null ;;
    *) echo "gpu_check: no stage '$1' (tests h2d folders stream quant quick step)"; exit 2 ;;
    esac
}
for stage in $STAGES; do  # in the order given
    has "$stage" && run_stage "$stage"
done

step "summary"
{
    echo "torch/GPU: $(tail -1 "$OUT/torch.txt")"
    want tests && echo "cuda tests: $(tail -1 "$OUT/pytest_cuda.txt" 2>/dev/null) (exit $tests_rc)"
    want h2d && echo "bandwidth: $(tail -1 "$OUT/h2d.txt" 2>/dev/null)"
    if want stream; then echo "stream benchmark (exit $stream_rc):"; grep '^|' "$OUT/stream_ram_cuda.txt" 2>/dev/null; fi
    if want quant; then echo "quantized streaming (exit $quant_rc; issue-18 bar: q4_0 pass <= 0.33x bf16):"; grep '^|' "$OUT/stream_quant_cuda.txt" 2>/dev/null; fi
    if want quick; then echo "step benchmark, quick (exit $quick_rc):"; sed -n '/issue-17 and issue-23 bars/,$p' "$OUT/gpu_step_quick.txt" 2>/dev/null; fi
    if want step; then echo "step benchmark (exit $step_rc):"; sed -n '/issue-17 and issue-23 bars/,$p' "$OUT/gpu_step.txt" 2>/dev/null; fi
    echo "total: $(( $(date +%s) - start )) s"
} | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$stream_rc" -eq 0 ] && [ "$quant_rc" -eq 0 ] && [ "$step_rc" -eq 0 ] && [ "$quick_rc" -eq 0 ]

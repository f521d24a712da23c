#!/usr/bin/env bash
# Measure and store the acceptance vectors of the embedded default target (SmolLM2-135M-Instruct)
# with each of its drafts at temperatures 0 and 0.6, on-policy over benchmarks/prompts.jsonl
# (40 chat prompts). The files land in hw_profiles/acceptance/, where --tree sequoia finds them.
#
#   scripts/measure_default_acceptance.sh [draft ...]     (default: self-int8 self-int4 default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
drafts=("$@")
[ ${#drafts[@]} -eq 0 ] && drafts=(self-int8 self-int4 default)
for draft in "${drafts[@]}"; do
  for t in 0 0.6; do
    name="smollm2-135m-instruct__${draft}__t${t}.json"
    "$PY" -m offload_engine acceptance --target default --draft "$draft" --offload none \
      --prompts benchmarks/prompts.jsonl --width 16 --max-new-tokens 96 --temperature "$t" --seed 0 \
      --out "hw_profiles/acceptance/$name"
  done
done

#!/usr/bin/env bash
# Measure and store the acceptance vectors of the embedded default target (SmolLM2-135M-Instruct)
# with each of its drafts at temperatures 0 and 0.6, on-policy over benchmarks/prompts.jsonl
# (40 chat prompts). The files land in hw_profiles/acceptance/, where --tree auto and
# --tree sequoia find them.
#
# Measured the way the planner uses them (since 2026-12-06): deep measuring trees (16 children
# below the root, 8 levels; the default draft, which the target leaves at the first or second
# token, 3 levels), every node of each accepted path counted (`RankEvidence`), and the target
# disk-streamed, as `demo` runs it without a GPU (a substitute draft's key then has no -r<n>:
# with --offload none every layer is resident and self-q8 is another draft, self-q8-r30).
# A stored vector is data about today's drafts: run this again after any change to a draft's
# numbers (self-int8's stored 0.972 was of the self-int8 of 2026-11-30; by 2026-12-06 it read
# 0.914 measured the old way and 0.942 this way; docs/choosing-the-tree.md).
#
#   scripts/measure_default_acceptance.sh [draft ...]
#       (default: self-q8 self-q4 self-int8 self-int4 default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
drafts=("$@")
[ ${#drafts[@]} -eq 0 ] && drafts=(self-q8 self-q4 self-int8 self-int4 default)
for draft in "${drafts[@]}"; do
  depth=8
  [ "$draft" = default ] && depth=3
  for t in 0 0.6; do
    name="smollm2-135m-instruct__${draft}__t${t}.json"
    "$PY" -m offload_engine acceptance --target default --draft "$draft" --offload disk \
      --prompts benchmarks/prompts.jsonl --width 16 --depth "$depth" --max-new-tokens 96 \
      --temperature "$t" --seed 0 --out "hw_profiles/acceptance/$name"
  done
done

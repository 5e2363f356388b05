#!/usr/bin/env bash
# One benchmark module on two trees back to back, on this machine: an earlier commit's tree (BEFORE, made
# with `git archive <commit> service benchmarks tests examples pyproject.toml | tar -x -C DIR`) and this
# checkout. JSON results into OUT (default benchmarks/results) as NAME-before.json and NAME-after.json.
#   BEFORE=.before OUT=/tmp/ab bash benchmarks/probes/ab.sh grpo benchmarks.grpo --models qwen2.5-7b --reps 3
# PYTHONPATH's other entries (e.g. the wheels of an offline GPU host) are kept, after each tree.
set -uo pipefail
name=$1; shift; module=$1; shift
before=$(cd "${BEFORE:?BEFORE: the earlier tree}" && pwd)
out=$(mkdir -p "${OUT:-benchmarks/results}" && cd "${OUT:-benchmarks/results}" && pwd)
for side in before after; do
  dir=$PWD; [ "$side" = before ] && dir=$before
  echo "=== $name $side ($(date +%T))"
  (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
     python3 -m "$module" "$@" --output "$out/$name-$side.json")
done

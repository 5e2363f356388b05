#!/usr/bin/env bash
# A newcomer's first score: clone COMMIT (default HEAD) into a fresh folder, run `make serve` there in
# the background, poll the README's curl until it scores; print the seconds to the first score and
# the size and package count of the .venv it made. pip's cache is left as it is (say warm or cold).
#   bash benchmarks/probes/first_score.sh [COMMIT] [PORT]
set -euo pipefail
commit=${1:-HEAD}; port=${2:-8765}
repo=$(git rev-parse --show-toplevel)
dir=$(mktemp -d)/logprobd
git clone -q "$repo" "$dir" && git -C "$dir" checkout -q "$commit"
cd "$dir"
start=$(date +%s.%N)
setsid make serve ARGS="--port $port" > serve.log 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null || true' EXIT
body='{"input_ids": [[1, 2, 3, 4, 5], [1, 2, 6]], "num_actions": [2, 1]}'
until curl -sf "localhost:$port/logprobs" -H 'content-type: application/json' -d "$body" > /dev/null; do
  kill -0 "$server" 2>/dev/null || { cat serve.log; exit 1; }
  sleep 0.5
done
end=$(date +%s.%N)
packages=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null | wc -l)
printf 'commit %s: first score %.1f s, .venv %s, %s packages\n' "$(git rev-parse --short HEAD)" \
  "$(echo "$end - $start" | bc)" "$(du -sh .venv | cut -f1)" "$packages"

#!/usr/bin/env bash
# Policy benchmark: clawrl (Burn, Flex CPU backend; `clawrl check speed`) against Hugging Face
# transformers on PyTorch CPU (`scripts/bench_reference.py speed`), the same random checkpoint of
# the benches/shapes/qwen3-20m shape, the same thread count, the workloads of
# benches/shapes/README.md: prefill 512 tokens at batch 1; 128 new tokens after a 32-token prompt
# at batch 1 and batch 16 (greedy, KV cache on). The two sides run interleaved, ROUNDS rounds
# (default 3); each side reports the median of its own 3 timed runs after a warm-up, and the
# table holds the median of the rounds and of the per-round ratios, with the load average before
# and after (scripts/bench_interleaved.py).
#
# The reference is installed from PyPI into target/bench-venv on first use (torch + transformers;
# the torch wheel is large). THREADS (default: nproc) sets the thread count of both sides.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_setup.sh
. scripts/bench_setup.sh

ours="env RAYON_NUM_THREADS=$THREADS RUST_LOG=warn target/release/clawrl check speed $MODEL"
theirs="env OMP_NUM_THREADS=$THREADS $VENV/bin/python scripts/bench_reference.py speed $MODEL --threads $THREADS"
echo "threads: $THREADS"
exec python3 scripts/bench_interleaved.py --rounds "$ROUNDS" \
  --pair "prefill 512" "$ours --workload prefill --prompt 512" "$theirs --workload prefill --prompt 512 2>/dev/null" \
  --pair "decode batch 1" "$ours --workload generate --batch 1 --prompt 32 --new-tokens 128" \
    "$theirs --workload generate --batch 1 --prompt 32 --new-tokens 128 2>/dev/null" \
  --pair "decode batch 16" "$ours --workload generate --batch 16 --prompt 32 --new-tokens 128" \
    "$theirs --workload generate --batch 16 --prompt 32 --new-tokens 128 2>/dev/null" \
  "$@"

#!/usr/bin/env bash
# Trainer benchmark: one training step (forward + backward + global-norm clip + AdamW) of the
# docs/design.md §1 loss on a random checkpoint of the qwen3-20m shape, batch 8 × 256 tokens
# (128 prompt + 128 response): clawrl (Burn, Flex CPU; `clawrl check speed --workload train`)
# against PyTorch CPU (transformers Qwen3ForCausalLM, torch.optim.AdamW, the same loss;
# `scripts/bench_reference.py speed --workload train`), the same thread count, interleaved
# ROUNDS rounds (default 3) with the medians, the median ratio, peak RSS and the load average
# (scripts/bench_interleaved.py).
#
# The reference is installed from PyPI into target/bench-venv on first use (shared with
# scripts/bench_model.sh). THREADS (default: nproc) sets both sides' threads.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_setup.sh
. scripts/bench_setup.sh

echo "threads: $THREADS"
exec python3 scripts/bench_interleaved.py --rounds "$ROUNDS" \
  --pair "train 8 x 256" \
    "env RAYON_NUM_THREADS=$THREADS RUST_LOG=warn target/release/clawrl check speed $MODEL --workload train --batch 8 --prompt 128 --new-tokens 128 --rounds 2" \
    "env OMP_NUM_THREADS=$THREADS $VENV/bin/python scripts/bench_reference.py speed $MODEL --threads $THREADS --workload train --batch 8 --prompt 128 --new-tokens 128 --rounds 2 2>/dev/null" \
  "$@"

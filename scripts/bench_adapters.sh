#!/usr/bin/env bash
# Multi-adapter decode: one engine over the benches/shapes/qwen3-20m shape decoding a batch of
# BATCH (default 16) greedy requests spread over ADAPTERS (default 4) LoRA adapters of rank RANK
# (default 16) on every linear layer, against the same batch on the base alone: `clawrl check
# speed --workload decode` both sides (decode steps only, after a 32-token prompt, 128 new tokens
# each), interleaved ROUNDS rounds (default 3) with the load average noted
# (scripts/bench_interleaved.py). The ratio column is adapters / base.
#
# The random checkpoint is made once into target/bench-cache (with the venv of
# scripts/bench_model.sh, installed on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-3}"
BATCH="${BATCH:-16}"
ADAPTERS="${ADAPTERS:-4}"
RANK="${RANK:-16}"
VENV=target/bench-venv
MODEL=target/bench-cache/qwen3-20m
if [ ! -s "$MODEL/model.safetensors" ]; then
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q torch transformers
  fi
  "$VENV/bin/python" scripts/bench_reference.py make-model --config benches/shapes/qwen3-20m/config.json --out "$MODEL" >/dev/null
fi
cargo build -q --release --locked --bin clawrl
speed="env RAYON_NUM_THREADS=$THREADS RUST_LOG=warn target/release/clawrl check speed $MODEL --workload decode --batch $BATCH --prompt 32 --new-tokens 128"
echo "threads: $THREADS; batch $BATCH over $ADAPTERS adapters of rank $RANK vs the base alone"
exec python3 scripts/bench_interleaved.py --rounds "$ROUNDS" \
  --pair "decode batch $BATCH, $ADAPTERS adapters r$RANK" "$speed --adapters $ADAPTERS --adapter-rank $RANK" "$speed" \
  "$@"

# Sourced by scripts/bench_model.sh and scripts/bench_train.sh: the shared setup of a policy or
# trainer benchmark against the PyTorch reference. Sets THREADS (default: nproc) and ROUNDS
# (default 3) unless given, installs torch + transformers into target/bench-venv ($VENV) on first
# use, builds the clawrl program, and writes the random qwen3-20m checkpoint both sides load
# ($MODEL) unless it exists.
THREADS="${THREADS:-$(nproc)}"
ROUNDS="${ROUNDS:-3}"
VENV=target/bench-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch transformers
fi
cargo build -q --release --locked --bin clawrl
MODEL=target/bench-cache/qwen3-20m
[ -s "$MODEL/model.safetensors" ] ||
  "$VENV/bin/python" scripts/bench_reference.py make-model --config benches/shapes/qwen3-20m/config.json --out "$MODEL" >/dev/null

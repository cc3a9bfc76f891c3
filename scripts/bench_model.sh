#!/usr/bin/env bash
# Policy benchmark: clawrl (Burn, Flex CPU backend) vs Hugging Face transformers on PyTorch CPU,
# same Qwen3 shape (benches/shapes/qwen3-20m), same thread count, same workloads
# (benches/shapes/README.md): prefill 512 tokens at batch 1; decode 128 new tokens after a
# 32-token prompt at batch 1 and batch 16 (greedy, KV cache on). Prints both sides and the ratios.
#
# The reference is installed from PyPI into target/bench-venv on first use (torch + transformers;
# the torch wheel is large). THREADS (default: nproc) sets the thread count of both sides.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-$(nproc)}"
VENV=target/bench-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch transformers
fi

ours=$(RAYON_NUM_THREADS="$THREADS" cargo bench -q --bench model_generate 2>/dev/null | tail -1)
theirs=$(OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" - "$THREADS" <<'PY'
import json, sys, time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
cfg = Qwen3Config(**json.load(open("benches/shapes/qwen3-20m/config.json")))
model = Qwen3ForCausalLM(cfg).float().eval()
V = cfg.vocab_size
def prompt(n, salt):
    return [(i * 7919 + salt * 104729 + 13) % V for i in range(n)]
with torch.inference_mode():
    ids = torch.tensor([prompt(512, 0)])
    model(ids, logits_to_keep=1)
    best = min(
        (lambda t0: (model(ids, logits_to_keep=1), time.perf_counter() - t0)[1])(time.perf_counter())
        for _ in range(3)
    )
    prefill = 512 / best
    def decode(batch):
        x = torch.tensor([prompt(32, i + 1) for i in range(batch)])
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=128,
                             min_new_tokens=128, do_sample=False, pad_token_id=0)
        return (out.shape[1] - 32) * batch / (time.perf_counter() - t0)
    decode(1)
    d1 = decode(1)
    d16 = decode(16)
print(json.dumps({"prefill_512_tokens_per_s": prefill, "decode_b1_tokens_per_s": d1,
                  "decode_b16_tokens_per_s": d16}))
PY
)
python3 - "$ours" "$theirs" "$THREADS" <<'PY'
import json, sys
o, t, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"threads: {n}")
print(f"{'measure':32} {'clawrl':>10} {'transformers':>13} {'ratio':>7} target")
for k, target in [("prefill_512_tokens_per_s", ">= 0.5x"), ("decode_b1_tokens_per_s", ">= 1x"),
                  ("decode_b16_tokens_per_s", ">= 3x generate")]:
    print(f"{k:32} {o[k]:10.1f} {t[k]:13.1f} {o[k] / t[k]:6.2f}x {target}")
PY

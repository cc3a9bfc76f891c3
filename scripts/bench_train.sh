#!/usr/bin/env bash
# Trainer benchmark: one training step (forward + backward + global-norm clip + AdamW) of the
# docs/design.md §1 loss on the qwen3-20m shape, batch 8 x 256 tokens (128 prompt + 128 response):
# clawrl (Burn, Flex CPU) vs PyTorch CPU (transformers Qwen3ForCausalLM, torch.optim.AdamW,
# the same loss), same thread count, in one invocation. Prints both sides and the ratios.
#
# The reference is installed from PyPI into target/bench-venv on first use (shared with
# scripts/bench_model.sh). THREADS (default: nproc) sets both sides' threads; BENCH_STEPS timed
# steps after one warm-up (default 2; the best is reported).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-$(nproc)}"
STEPS="${BENCH_STEPS:-2}"
VENV=target/bench-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch transformers
fi

ours=$(RAYON_NUM_THREADS="$THREADS" BENCH_STEPS="$STEPS" cargo bench -q --bench train_step | tail -1)
theirs=$(OMP_NUM_THREADS="$THREADS" "$VENV/bin/python" - "$THREADS" "$STEPS" <<'PY'
import json, resource, sys, time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.set_num_threads(int(sys.argv[1]))
steps = int(sys.argv[2])
torch.manual_seed(0)
cfg = Qwen3Config(**json.load(open("benches/shapes/qwen3-20m/config.json")))
model = Qwen3ForCausalLM(cfg).float().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
V = cfg.vocab_size
tok = lambda i, salt: (i * 7919 + salt * 104729 + 13) % V
ids = torch.tensor([[tok(i, b + 1) for i in range(256)] for b in range(8)])
adv = torch.tensor([[(1.0 if b % 2 == 0 else -1.0) + 0.01 * k for k in range(128)] for b in range(8)])
old = torch.tensor([[-9.0 + 0.001 * k for k in range(128)]] * 8)
ref = torch.tensor([[-9.0 - 0.001 * k for k in range(128)]] * 8)
def step():
    logits = model(ids[:, :-1]).logits[:, 127:]            # positions predicting the response
    new = torch.log_softmax(logits, -1).gather(-1, ids[:, 128:, None]).squeeze(-1)
    ratio = torch.exp(new - old)
    pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 0.8, 1.28) * adv)
    d = torch.clamp(ref - new, -10, 10)
    kl = torch.exp(d) - 1 - d
    loss = (pg + 0.02 * kl).mean(-1).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
step()
best = float("inf")
for _ in range(steps):
    t0 = time.perf_counter(); step(); best = min(best, time.perf_counter() - t0)
print(json.dumps({"tokens_per_step": 2048, "step_seconds": best, "tokens_per_s": 2048 / best,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
PY
)
echo "clawrl:  $ours"
echo "pytorch: $theirs"
python3 - "$ours" "$theirs" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"train tokens/s ratio (clawrl / pytorch): {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")
print(f"peak RSS ratio (clawrl / pytorch): {a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x")
PY

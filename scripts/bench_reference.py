#!/usr/bin/env python3
"""The PyTorch side of the device benchmark: Hugging Face `transformers` Qwen3ForCausalLM on the
same checkpoint and the same workloads as `clawrl check speed`, printing the same JSON.

  bench_reference.py make-model --config SHAPE.json --out DIR [--tokenizer DIR] [--seed 0]
      writes a checkpoint with random weights of that shape (bf16 safetensors, HF layout) and the
      tokenizer files of DIR, for both sides to load.
  bench_reference.py logits FIXTURE --device cpu|cuda
      the fixture's logits along its greedy continuations in float32 on the CPU (and their error
      against expected.json), and with --device cuda on the GPU with TF32 matmuls off and on,
      each against the CPU's: how far a GPU's float32 moves PyTorch itself.
  bench_reference.py speed MODEL --workload generate|prefill|train --device cpu|cuda
      [--dtype float32|bfloat16] [--batch N] [--prompt N] [--new-tokens N] [--rounds N]
      [--threads N]

Workloads (the prompt ids are the formula `(i * 7919 + salt * 104729 + 13) % vocab` on both sides):
- generate: `batch` prompts of `prompt` tokens (salt = row + 1), greedy, exactly `new_tokens`
  new tokens each, KV cache on; tokens/s of generated tokens.
- prefill: one forward over `prompt` tokens (salt 0) filling the KV cache, last logits only.
- train: one step of the docs/design.md section 1 loss (clipped ratio 0.2 / 0.28, k3 KL 0.02,
  per-sample token mean) on `batch` sequences of `prompt + new_tokens` tokens, global-norm clip
  1.0, AdamW (betas 0.9 / 0.98, eps 1e-8, weight decay 0.1); tokens/s of all sequence tokens.
  In bfloat16 the weights and optimizer stay float32 under autocast (mixed precision).

Each workload runs once to warm up (a short generate), then `rounds` timed rounds; the median is
reported. On CUDA every timed round ends with a synchronize.
"""
import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def tok(i, salt, vocab):
    return (i * 7919 + salt * 104729 + 13) % vocab


def make_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3Config(**json.loads(Path(args.config).read_text()))
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.tokenizer) / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "parameters": params}))


def logits(args):
    from transformers import Qwen3ForCausalLM

    expected = json.loads((Path(args.fixture) / "expected.json").read_text())

    def run(device, tf32):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        model = Qwen3ForCausalLM.from_pretrained(args.fixture, dtype=torch.float32).to(device)
        rows = []
        with torch.inference_mode():
            for case in expected["cases"]:
                ids = case["input_ids"] + case["greedy_16"]
                out = model.eval()(torch.tensor([ids], device=device)).logits[0].float().cpu()
                rows.append(out[len(case["input_ids"]) - 1:-1])
        return rows

    def errors(rows, want_rows):
        out = []
        for case, got, want in zip(expected["cases"], rows, want_rows):
            greedy = torch.tensor(case["greedy_16"])[:, None]
            lp = torch.log_softmax(got, -1).gather(-1, greedy).squeeze(-1)
            want_lp = torch.log_softmax(want, -1).gather(-1, greedy).squeeze(-1)
            out.append({
                "last_logits_rel_err": ((got[0] - want[0]).abs().max() / want[0].abs().max()).item(),
                "greedy_logprobs_max_abs_err": (lp - want_lp).abs().max().item(),
                "greedy_equal": got.argmax(-1).tolist() == case["greedy_16"],
            })
        return out

    cpu = run(torch.device("cpu"), False)
    fixture = [torch.tensor([c["last_logits"]]) for c in expected["cases"]]
    result = {"cpu_vs_fixture": [
        {"last_logits_rel_err": ((r[0] - f[0]).abs().max() / f[0].abs().max()).item()}
        for r, f in zip(cpu, fixture)]}
    if args.device == "cuda":
        dev = torch.device("cuda:0")
        result["cuda_f32_vs_cpu"] = errors(run(dev, False), cpu)
        result["cuda_tf32_vs_cpu"] = errors(run(dev, True), cpu)
    print(json.dumps(result))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def speed(args):
    from transformers import Qwen3ForCausalLM

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    train = args.workload == "train"
    # Training keeps float32 master weights; bfloat16 is then autocast.
    load_dtype = torch.float32 if train else dtype
    model = Qwen3ForCausalLM.from_pretrained(args.model, dtype=load_dtype).to(device)
    vocab = model.config.vocab_size
    B, P, N = args.batch, args.prompt, args.new_tokens

    if args.workload == "generate":
        model.eval()
        x = torch.tensor([[tok(i, b + 1, vocab) for i in range(P)] for b in range(B)], device=device)
        mask = torch.ones_like(x)

        def round_(n=N):
            with torch.inference_mode():
                out = model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0)
            sync(device)
            return (out.shape[1] - P) * B

        warm = lambda: round_(min(N, 4))
    elif args.workload == "prefill":
        model.eval()
        ids = torch.tensor([[tok(i, 0, vocab) for i in range(P)]], device=device)

        def round_():
            with torch.inference_mode():
                model(ids, use_cache=True, logits_to_keep=1)
            sync(device)
            return P

        warm = round_
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.98), eps=1e-8,
                                weight_decay=0.1)
        R = max(N, 1)
        seqs = torch.tensor([[tok(i, b + 1, vocab) for i in range(P + R)] for b in range(B)],
                            device=device)
        adv = torch.tensor([[(1.0 if b % 2 == 0 else -1.0) + 0.01 * k for k in range(R)]
                            for b in range(B)], device=device)
        old = torch.tensor([[-9.0 + 0.001 * k for k in range(R)]] * B, device=device)
        ref = torch.tensor([[-9.0 - 0.001 * k for k in range(R)]] * B, device=device)
        autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                  enabled=dtype == torch.bfloat16)

        def round_():
            with autocast:
                logits = model(seqs[:, :-1]).logits[:, P - 1:]
            new = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, P:, None]).squeeze(-1)
            ratio = torch.exp(new - old)
            pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 0.8, 1.28) * adv)
            d = torch.clamp(ref - new, -10, 10)
            kl = torch.exp(d) - 1 - d
            loss = (pg + 0.02 * kl).mean(-1).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sync(device)
            return B * (P + R)

        warm = round_

    warm()
    rates = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        n = round_()
        rates.append(n / (time.perf_counter() - t0))
    print(json.dumps({
        "device": str(device), "workload": args.workload, "batch": B, "prompt": P,
        "new_tokens": N, "dtype": args.dtype, "tokens_per_s": statistics.median(rates),
        "rounds_tokens_per_s": rates,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--config", required=True)
    m.add_argument("--tokenizer", help="a folder with tokenizer.json and tokenizer_config.json "
                   "to copy (the speed workloads need none)")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=0)
    lg = sub.add_parser("logits")
    lg.add_argument("fixture")
    lg.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s = sub.add_parser("speed")
    s.add_argument("model")
    s.add_argument("--workload", required=True, choices=["generate", "prefill", "train"])
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--prompt", type=int, default=128)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    a = p.parse_args()
    if a.cmd == "speed" and (a.batch < 1 or a.prompt < 1 or a.rounds < 1):
        sys.exit("--batch, --prompt and --rounds must be at least 1")
    {"make-model": make_model, "logits": logits, "speed": speed}[a.cmd](a)


if __name__ == "__main__":
    main()

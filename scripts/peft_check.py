#!/usr/bin/env python3
"""Checks that Hugging Face PEFT loads the LoRA adapters clawrl writes and computes what clawrl
computes with them (not part of the test suite: it needs torch, transformers and peft).

It writes two adapters with the built binary: the fixture adapter after one `train-offline`
step (`--adapter tests/fixtures/qwen3-tiny-lora`) and a fresh rank-8 adapter on q_proj and
v_proj after one step (`--lora 8,16,q_proj,v_proj`). For each, on the four conversations of
tests/fixtures/qwen3-tiny/expected.json, it compares
  - PEFT (`PeftModel.from_pretrained` over the base loaded in float32) with
    `clawrl model logits --adapter`, and
  - `transformers` alone on the checkpoint `clawrl lora merge` writes with the same logits,
and exits non-zero when a last-position logits row differs by more than 1e-4 relative.
clawrl runs on a copy of the base whose config.json declares float32, as transformers computes
when it loads the base in float32 (RoPE frequencies not rounded to bf16).

  PYTHONPATH=target/peft-pkgs /work/lead/target/bench-venv/bin/python scripts/peft_check.py
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAWRL = os.path.join(ROOT, "target/release/clawrl")
BASE = os.path.join(ROOT, "tests/fixtures/qwen3-tiny")
FIXTURE_ADAPTER = os.path.join(ROOT, "tests/fixtures/qwen3-tiny-lora")
SAMPLES = os.path.join(ROOT, "examples/offline/samples.jsonl")
TRAIN = os.path.join(ROOT, "examples/offline/train.toml")
TOLERANCE = 1e-4


def clawrl(*args):
    env = dict(os.environ, RUST_LOG="warn")
    return subprocess.run([CLAWRL, *args], check=True, stdout=subprocess.PIPE, text=True,
                          env=env).stdout


def float32_base(tmp):
    out = os.path.join(tmp, "base-f32")
    shutil.copytree(BASE, out)
    path = os.path.join(out, "config.json")
    cfg = json.load(open(path))
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = "float32"
    json.dump(cfg, open(path, "w"), indent=2)
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def main():
    cases = json.load(open(os.path.join(BASE, "expected.json")))["cases"]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        base = float32_base(tmp)
        adapters = {}
        for name, flag in [("trained-fixture", ["--adapter", FIXTURE_ADAPTER]),
                           ("fresh-r8-qv", ["--lora", "8,16,q_proj,v_proj"])]:
            out = os.path.join(tmp, name)
            clawrl("train-offline", "--model", BASE, *flag, "--samples", SAMPLES,
                   "--config", TRAIN, "--out", out, "--json")
            adapters[name] = out
        for name, adapter in adapters.items():
            cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
            peft_model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
            merged_dir = os.path.join(tmp, name + "-merged")
            clawrl("lora", "merge", "--base", base, "--adapter", adapter, "--out", merged_dir)
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
            for i, case in enumerate(cases):
                messages = os.path.join(tmp, f"m{i}.json")
                json.dump(case["messages"], open(messages, "w"))
                args = ["model", "logits", base, "--adapter", adapter, "--messages", messages,
                        "--json"]
                if case.get("tools") is not None:
                    tools = os.path.join(tmp, f"t{i}.json")
                    json.dump(case["tools"], open(tools, "w"))
                    args += ["--tools", tools]
                got = json.loads(clawrl(*args))
                assert got["input_ids"] == case["input_ids"], f"case {i}: prompt ids differ"
                ids = torch.tensor([case["input_ids"]])
                with torch.no_grad():
                    want = peft_model(ids).logits[0, -1]
                    want_merged = merged(ids).logits[0, -1]
                e_peft = rel(torch.tensor(got["last_logits"]), want)
                e_merged = rel(want_merged, want)
                worst = max(worst, e_peft, e_merged)
                print(f"{name} (r {cfg['r']}, {len(cfg['target_modules'])} targets) case {i}: "
                      f"clawrl vs PEFT {e_peft:.2e}, clawrl-merged in transformers vs PEFT "
                      f"{e_merged:.2e}")
    print(json.dumps({"max_relative_error": worst, "tolerance": TOLERANCE}))
    sys.exit(0 if worst < TOLERANCE else 1)


if __name__ == "__main__":
    main()

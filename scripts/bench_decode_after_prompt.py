#!/usr/bin/env python3
"""Decode speed after a long prompt against after a short one, through the generation engine.

    scripts/bench_decode_after_prompt.py --clawrl target/release/clawrl --model MODEL \
        [--batch 4] [--long 12000] [--short 32] [--rounds 3]

Each side is one `clawrl check speed --workload decode` round (`batch` requests of the prompt
length, 128 new tokens each, timed from the moment every request has its first token, so the
prefills are not counted). The long and short sides take turns (long, short, long, short, ...);
each side's median and the median of the per-round ratios (long / short) are printed as JSON,
with the load average before and after (a ratio from a busy machine is not a result).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def decode_rate(clawrl, model, batch, prompt, new=128):
    out = subprocess.run(
        [clawrl, "check", "speed", model, "--workload", "decode", "--batch", str(batch),
         "--prompt", str(prompt), "--new-tokens", str(new), "--rounds", "1"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--clawrl", required=True)
    a.add_argument("--model", required=True)
    a.add_argument("--batch", type=int, default=4)
    a.add_argument("--long", type=int, default=12000)
    a.add_argument("--short", type=int, default=32)
    a.add_argument("--rounds", type=int, default=3)
    args = a.parse_args()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.2f} > 0.5: the figures are not a result",
              file=sys.stderr)
    longs, shorts, ratios = [], [], []
    for r in range(args.rounds):
        lo = decode_rate(args.clawrl, args.model, args.batch, args.long)
        sh = decode_rate(args.clawrl, args.model, args.batch, args.short)
        longs.append(lo)
        shorts.append(sh)
        ratios.append(lo / sh)
        print(f"round {r + 1}: after {args.long}: {lo:.1f} tok/s, after {args.short}: {sh:.1f}",
              file=sys.stderr)
    print(json.dumps({
        "batch": args.batch, "long_prompt": args.long, "short_prompt": args.short,
        "decode_tokens_per_s_after_long": statistics.median(longs),
        "decode_tokens_per_s_after_short": statistics.median(shorts),
        "ratio_median": statistics.median(ratios), "ratios": ratios,
        "load_before": load_before, "load_after": os.getloadavg(),
    }))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Runs benchmark pairs interleaved and reports medians, so that both sides of a ratio see the
same machine: for each round, each pair's clawrl command then its reference command (A, B, A, B,
...). Each command prints one JSON object as its last line with `tokens_per_s` (and optionally
`peak_rss_mib`). Waits up to `--wait-idle` seconds for the 1-minute load average to fall to
`--max-load` first, prints the load average before and after (the benchmark's own threads raise
the one after), warns when the one before is above `--max-load`, and for every pair the median of each side, the median of the per-round ratios and
every round's figures; `--json FILE` also writes them.

  bench_interleaved.py --rounds 3 --pair NAME 'CLAWRL CMD' 'REFERENCE CMD' [--pair ...]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run(cmd):
    out = subprocess.run(cmd, shell=True, check=True, stdout=subprocess.PIPE, text=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        sys.exit(f"no JSON line from: {cmd}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-load", type=float, default=0.5)
    p.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "CLAWRL", "REFERENCE"),
                   required=True)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--wait-idle", type=float, default=120.0,
                   help="seconds to wait for the load to fall to --max-load before starting")
    a = p.parse_args()
    if a.rounds < 3:
        sys.exit("--rounds must be at least 3: a median of fewer says little")

    deadline = time.time() + a.wait_idle
    while os.getloadavg()[0] > a.max_load and time.time() < deadline:
        time.sleep(5)
    before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds = {name: [] for name, _, _ in a.pair}
    for r in range(a.rounds):
        for name, ours, theirs in a.pair:
            o, t = run(ours), run(theirs)
            rounds[name].append({"clawrl": o, "reference": t})
            print(f"round {r + 1} {name}: clawrl {o['tokens_per_s']:.1f}, "
                  f"reference {t['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    after = os.getloadavg()

    print(f"date: {started}; rounds: {a.rounds}, interleaved")
    print(f"load average before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}; "
          f"after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    if before[0] > a.max_load:
        print(f"WARNING: the 1-minute load average was above {a.max_load}: the machine was "
              "busy, and these ratios are not a result", file=sys.stderr)
        print(f"WARNING: load above {a.max_load}")
    print(f"{'measure':24} {'clawrl':>10} {'reference':>10} {'ratio':>7}  rounds (ratio)")
    result = {"date": started, "load_before": before, "load_after": after, "pairs": {}}
    for name, _, _ in a.pair:
        rs = rounds[name]
        ours = [x["clawrl"]["tokens_per_s"] for x in rs]
        theirs = [x["reference"]["tokens_per_s"] for x in rs]
        ratios = [o / t for o, t in zip(ours, theirs)]
        entry = {"clawrl_median": statistics.median(ours),
                 "reference_median": statistics.median(theirs),
                 "ratio_median": statistics.median(ratios), "ratios": ratios,
                 "clawrl": ours, "reference": theirs}
        rss = [(x["clawrl"].get("peak_rss_mib"), x["reference"].get("peak_rss_mib")) for x in rs]
        if all(o and t for o, t in rss):
            entry["peak_rss_mib"] = {"clawrl": statistics.median(o for o, _ in rss),
                                     "reference": statistics.median(t for _, t in rss)}
        result["pairs"][name] = entry
        print(f"{name:24} {entry['clawrl_median']:10.1f} {entry['reference_median']:10.1f} "
              f"{entry['ratio_median']:6.2f}x  " + " ".join(f"{x:.2f}" for x in ratios))
        if "peak_rss_mib" in entry:
            m = entry["peak_rss_mib"]
            print(f"{'  peak RSS, MiB':24} {m['clawrl']:10.0f} {m['reference']:10.0f} "
                  f"{m['clawrl'] / m['reference']:6.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

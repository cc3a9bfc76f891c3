#!/usr/bin/env python3
"""Time to first token of an agent-shaped conversation through `clawrl serve`, turn 1 against
turn 2, with the engine's prefix cache on and off.

Each request has the shape of an OpenClaw turn: a system prompt of about 40 KB, 12 tools and a
short user message; turn 2 repeats turn 1 and its answer and adds a user message. A request asks
for one token (`max_tokens: 1`), so its latency is the prefill of its prompt plus one sampled
token. Every conversation starts its system prompt with its own nonce, so turn 1 never finds a
cached prefix; the two gateways (cache on, cache off) take turns, conversation by conversation.

    scripts/bench_prefix.py --clawrl target/release/clawrl --model MODEL [--rounds 3]

Prints one JSON object: the median turn-1 and turn-2 seconds for each side, the ratio turn 2 /
turn 1, the prompt lengths and the cached tokens reported in `usage`.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request

WORDS = ("agent tool file memory channel session workspace command result policy message user "
         "context reply search browser schedule note task project skill config status").split()


def system_prompt(nonce, kb):
    out, i = [f"[conversation {nonce}] You are a personal agent."], 0
    while sum(len(s) + 1 for s in out) < kb * 1024:
        w = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)]
        out.append(f"Rule {i}: when the {w[0]} asks about the {w[1]}, check the {w[2]} and "
                   f"the {w[3]} first; never {w[4]} a {w[5]} without {w[6]} ({i * 37 % 1000}).")
        i += 1
    return "\n".join(out)


def tools(n):
    return [{"type": "function", "function": {
        "name": f"tool_{k}_{WORDS[k % len(WORDS)]}",
        "description": f"Operates on the {WORDS[(k * 5) % len(WORDS)]}: " + " ".join(WORDS[k:k + 9]),
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Where."},
            "limit": {"type": "integer", "description": "How many."},
            "mode": {"type": "string", "enum": ["read", "write", "list"]}},
            "required": ["path"]}}} for k in range(n)]


def start(clawrl, model, cache_mib, work):
    cfg = os.path.join(work, f"gateway-{cache_mib}.toml")
    with open(cfg, "w") as f:
        f.write(f'model_name = "bench"\nprefix_cache_mib = {cache_mib}\n'
                f'data_dir = "{work}/data-{cache_mib}"\nmax_body_bytes = 16777216\n')
    p = subprocess.Popen([clawrl, "serve", "--model", model, "--config", cfg, "--listen",
                          "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    addr = line.split("http://")[1].split()[0]
    return p, f"http://{addr}"


def ask(base, messages, tool_list):
    body = json.dumps({"model": "bench", "messages": messages, "tools": tool_list,
                       "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t0, out


def conversation(base, nonce, kb, tool_list):
    msgs = [{"role": "system", "content": system_prompt(nonce, kb)},
            {"role": "user", "content": "What is on my schedule for tomorrow?"}]
    t1, r1 = ask(base, msgs, tool_list)
    answer = r1["choices"][0]["message"]
    msgs += [{"role": "assistant", "content": answer.get("content") or ""},
             {"role": "user", "content": "Thanks. Move the first meeting to the afternoon."}]
    t2, r2 = ask(base, msgs, tool_list)
    return t1, t2, r1["usage"], r2["usage"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clawrl", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system-kb", type=int, default=40)
    ap.add_argument("--tools", type=int, default=12)
    ap.add_argument("--cache-mib", type=int, default=1024)
    a = ap.parse_args()
    tool_list = tools(a.tools)
    work = tempfile.mkdtemp(prefix="clawrl-bench-prefix-")
    sides = {"cache": start(a.clawrl, a.model, a.cache_mib, work),
             "no_cache": start(a.clawrl, a.model, 0, work)}
    got = {k: [] for k in sides}
    try:
        for r in range(a.rounds):
            for name, (_, base) in sides.items():
                got[name].append(conversation(base, f"{name}-{r}", a.system_kb, tool_list))
    finally:
        for p, _ in sides.values():
            p.terminate()
            p.wait()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    report = {"load_average": load, "rounds": a.rounds}
    for name, runs in got.items():
        t1 = statistics.median(x[0] for x in runs)
        t2 = statistics.median(x[1] for x in runs)
        report[name] = {
            "turn1_s": round(t1, 3), "turn2_s": round(t2, 3), "turn2_over_turn1": round(t2 / t1, 3),
            "turn1_s_all": [round(x[0], 3) for x in runs],
            "turn2_s_all": [round(x[1], 3) for x in runs],
            "prompt_tokens": [runs[0][2]["prompt_tokens"], runs[0][3]["prompt_tokens"]],
            "cached_tokens": [x[3]["prompt_tokens_details"]["cached_tokens"] for x in runs]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

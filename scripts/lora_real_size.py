#!/usr/bin/env python3
"""A `personal` job that trains a LoRA adapter over a real-size checkpoint, measured.

    scripts/lora_real_size.py --model DIR [--clawrl target/release/clawrl] [--out DIR]
                              [--rank 16] [--steps 2] [--max-new-tokens 16]
                              [--method binary|combined]

DIR is a Hugging Face Qwen3 checkpoint with the tokenizer files (for the Qwen3-0.6B shape with
random weights and the real tokenizer: `scripts/bench_reference.py make-model --config
benches/shapes/qwen3-0.6b/config.json --tokenizer TOKENIZER_DIR --out DIR`). The job serves the
checkpoint over its gateway and trains a fresh rank-R adapter on every linear layer (`--rank 0`:
the whole model instead, for comparison). This script talks to it over HTTP as a user would
(sessions of two turns: the user thanks the first answer and calls the second wrong, so a
scripted judge scores them +1 and -1) until the trainer has taken `--steps` steps and the gateway
serves the last version. It then stops the job (SIGTERM) and prints, as JSON: the process's peak
RSS (sampled every 0.5 s, so also for a job the kernel kills for memory), each step's time,
export and publish time, the size of a version on the wire, and the gateway's install time.
`--method combined` adds the OPD teacher the job runs for it (the judge here gives no hints, so
it trains on the binary term): the difference in peak RSS is what the teacher costs.

Standard library only.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

KEY = "sk-lora-real-size"


def spec(model: Path, out: Path, rank: int, max_new: int, method: str) -> str:
    lora = (
        f'lora = {{ r = {rank}, alpha = {2 * rank}, targets = ["q_proj", "k_proj", "v_proj", '
        f'"o_proj", "gate_proj", "up_proj", "down_proj"] }}'
        if rank > 0
        else ""
    )
    return f"""
kind = "personal"
name = "lora-real-size"
seed = 1
[policy]
checkpoint = {json.dumps(str(model))}
max_new_tokens = {max_new}
{lora}
[gateway]
listen = "127.0.0.1:0"
model_name = "real"
api_keys = ["{KEY}"]
data_dir = {json.dumps(str(out / "turns"))}
default_max_tokens = {max_new}
max_context = 2048
[judge]
backend = "scripted"
votes = 1
rules = [{{ pattern = "(?i)thanks", score = 1 }}, {{ pattern = "(?i)wrong", score = -1 }}]
default_score = 0
[method]
kind = "{method}"
[optim]
batch_size = 2
lr = 1e-4
clip = 0.2
kl = 0.0
staleness = 8
[stop]
max_hours = 2.0
"""


def chat(base: str, messages, headers):
    body = json.dumps({"model": "real", "messages": messages}).encode()
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def peak_rss_mib(pid: int):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--clawrl", default="target/release/clawrl")
    ap.add_argument("--out", type=Path, default=Path("target/lora-real-size"))
    ap.add_argument("--rank", type=int, default=16, help="0: full fine-tuning, for comparison")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--method", choices=["binary", "combined"], default="binary")
    a = ap.parse_args()

    out = a.out.resolve()
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    job = out / "job.toml"
    job.write_text(spec(a.model.resolve(), out / "run", a.rank, a.max_new_tokens, a.method))
    started = time.time()
    child = subprocess.Popen(
        [a.clawrl, "run", "--json", "--out", str(out / "run"), str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = None
    log = []
    ready = threading.Event()

    def read_stderr():
        nonlocal base
        for line in child.stderr:
            log.append(line)
            if base is None and "listening on http://" in line:
                base = line[line.index("http://"):].split()[0].rstrip(".,")
                ready.set()
        ready.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    peak = [0.0]

    def sample_rss():
        while child.poll() is None:
            rss = peak_rss_mib(child.pid)
            if rss is not None:
                peak[0] = max(peak[0], rss)
            time.sleep(0.5)

    threading.Thread(target=sample_rss, daemon=True).start()

    def died():
        child.wait()
        print(
            json.dumps(
                {
                    "model": str(a.model),
                    "rank": a.rank,
                    "error": f"the job died with status {child.returncode}",
                    "peak_rss_mib": peak[0],
                    "log_tail": "".join(log[-5:]),
                },
                indent=2,
            )
        )
        sys.exit(1)

    ready.wait(1800)
    if base is None:
        if child.poll() is not None:
            died()
        sys.exit("the job never listened:\n" + "".join(log[-40:]))
    listening_s = time.time() - started
    print(f"gateway at {base} after {listening_s:.1f} s", file=sys.stderr)

    records = out / "run" / "records"

    def steps_recorded():
        steps = []
        if records.exists():
            for f in records.iterdir():
                for line in f.read_text().splitlines():
                    try:
                        v = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if v.get("kind") == "trainer_step":
                        steps.append(v["record"])
        return sorted(steps, key=lambda s: s["step"])

    def talk(messages, headers):
        try:
            return chat(base, messages, headers)
        except OSError:
            if child.poll() is not None:
                died()
            raise

    turn_s = []
    session = 0
    while True:
        steps = steps_recorded()
        if len(steps) >= a.steps:
            probe = talk([{"role": "user", "content": "hi"}], {"X-Turn-Type": "side"})
            if probe.get("version", 0) >= steps[-1]["version"]:
                break
            time.sleep(1)
            continue
        sid = f"user-{session}"
        session += 1
        messages = [{"role": "user", "content": f"Tell me one thing about topic {session}."}]
        t = time.time()
        b = talk(messages, {"X-Session-Id": sid})
        turn_s.append(time.time() - t)
        messages += [
            {"role": "assistant", "content": b["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": "Thanks, that helps! Another one?"},
        ]
        t = time.time()
        b = talk(messages, {"X-Session-Id": sid})
        turn_s.append(time.time() - t)
        messages += [
            {"role": "assistant", "content": b["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": "That is wrong."},
        ]
        talk(messages, {"X-Session-Id": sid, "X-Session-Done": "1"})
    child.send_signal(signal.SIGTERM)
    stdout = child.stdout.read()
    child.wait(timeout=1800)
    steps = steps_recorded()
    result = {
        "model": str(a.model),
        "rank": a.rank,
        "method": a.method,
        "peak_rss_mib": peak[0],
        "startup_s": round(listening_s, 1),
        "turn_s": [round(x, 2) for x in turn_s],
        "steps": [
            {k: s.get(k) for k in ("step", "version", "tokens", "step_ms", "export_ms", "publish_ms")}
            for s in steps
        ],
        "load_average": os.getloadavg(),
    }
    try:
        summary = json.loads(stdout)
        result["version_bytes"] = summary["agents"][0]["trainer"].get("published_bytes")
        result["gateway"] = summary["agents"][0]["gateway"]
    except json.JSONDecodeError:
        result["error"] = f"the job died while stopping (status {child.returncode})"
        result["log_tail"] = "".join(log[-5:])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

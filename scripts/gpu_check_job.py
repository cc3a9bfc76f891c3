#!/usr/bin/env python3
"""Drives a `personal` job for scripts/gpu_check.sh: starts `clawrl run JOB --json`, talks to its
gateway in scripted sessions (OpenAI chat completions with X-Session-Id; every user reply is the
next state, "thanks" or "wrong" for the scripted judge), alternating streamed and plain requests,
until a request is answered on weight version `--versions` (each answer names its version); then sends Ctrl-C, waits for the drained job's report and prints one JSON object:
requests, failed requests, versions seen in order, the install seconds of the last version, the
trainer steps' times and whether it all held (pass: no failed request, version 0 served first,
`--versions` switches made while the users kept talking, the last answer on that version)."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


JOBS = []  # the job process, killed if the driver ends early


def request(url, key, body=None, headers=None, timeout=60):
    h = {"Authorization": f"Bearer {key}", **(headers or {})}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=h)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--clawrl", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--versions", type=int, default=2)
    p.add_argument("--key", default="sk-check")
    p.add_argument("--model", default="gpu-check")
    p.add_argument("--deadline", type=float, default=150.0,
                   help="seconds of talking before giving up on the last version")
    a = p.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    job = subprocess.Popen([a.clawrl, "run", a.job, "--json", "--out", a.out],
                           stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    JOBS.append(job)
    result = {"requests": 0, "failed": 0, "errors": [], "versions_seen": [], "pass": False}
    started = time.time()

    def metrics():
        _, body = request(f"{base}/metrics", a.key, timeout=30)
        return body.decode()

    # Wait for the gateway (the checkpoint loads onto the device first).
    while True:
        if job.poll() is not None:
            result["errors"].append(f"the job exited early with {job.returncode}")
            print(json.dumps(result))
            return 1
        try:
            metrics()
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    result["serving_after_s"] = time.time() - started

    session, turn, stream = 0, 0, False
    history = []
    deadline = time.time() + a.deadline
    while True:
        if turn == 0:
            history = [{"role": "system", "content": "You are a helpful assistant."},
                       {"role": "user", "content": f"Session {session}: suggest a name for a cat."}]
        else:
            reply = "thanks, that is great" if (session + turn) % 2 else "wrong, try again"
            history.append({"role": "user", "content": reply})
        done = turn == 3
        headers = {"X-Session-Id": f"check-{session}"}
        if done:
            headers["X-Session-Done"] = "1"
        body = {"model": a.model, "messages": history, "max_tokens": 16, "temperature": 1.0,
                "stream": stream}
        result["requests"] += 1
        version = None
        try:
            _, raw = request(f"{base}/v1/chat/completions", a.key, body, headers)
            if stream:
                text = ""
                for line in raw.decode().splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        version = chunk.get("version", version)
                        text += chunk["choices"][0]["delta"].get("content") or ""
            else:
                answer = json.loads(raw)
                version = answer.get("version")
                text = answer["choices"][0]["message"]["content"] or ""
            history.append({"role": "assistant", "content": text})
        except Exception as e:  # every failure counts; the check reports them
            result["failed"] += 1
            result["errors"].append(f"request {result['requests']}: {e}")
            history.append({"role": "assistant", "content": ""})
        if version is not None and (not result["versions_seen"]
                                    or result["versions_seen"][-1] != version):
            result["versions_seen"].append(version)
        if version is not None and version >= a.versions:
            break  # a request answered on the last version
        if result["failed"] >= 3:
            result["errors"].append("stopped after 3 failed requests")
            break
        if time.time() > deadline:
            result["errors"].append(f"no answer on version {a.versions} within {a.deadline} s")
            break
        stream = not stream
        turn += 1
        if done:
            session, turn = session + 1, 0

    m = metrics()
    result["install_s_last"] = metric(m, "clawrl_gateway_weight_install_seconds")
    result["weight_switches"] = metric(m, "clawrl_gateway_weight_switches_total")
    job.send_signal(signal.SIGINT)
    out, _ = job.communicate(timeout=120)
    result["job_exit"] = job.returncode
    try:
        # The summary is the JSON object (pretty-printed) that ends stdout.
        report = json.loads(out[out.index("\n{") + 1:] if not out.startswith("{") else out)
    except ValueError:
        report = None
        result["errors"].append("no JSON report from the job")
    steps = []
    records = os.path.join(a.out, "records")
    for root, _, files in os.walk(records):
        for f in files:
            if f.endswith(".jsonl"):
                for line in open(os.path.join(root, f)):
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if r.get("kind") == "trainer_step":
                        steps.append(r["record"])
    result["trainer_steps"] = [
        {k: s.get(k) for k in ("version", "step_ms", "export_ms", "publish_ms", "loss", "tokens")}
        for s in sorted(steps, key=lambda s: s.get("version", 0))
    ]
    if report is not None:
        agent = (report.get("agents") or [{}])[0]
        result["report"] = {k: report.get(k) for k in ("stopped_by", "counts")}
        result["report"].update({k: agent.get(k) for k in ("trainer", "gateway")})
    seen = result["versions_seen"]
    result["pass"] = (result["failed"] == 0 and job.returncode == 0 and report is not None
                      and (result["weight_switches"] or 0) >= a.versions
                      and bool(seen) and seen[0] == 0 and seen[-1] >= a.versions)
    result["wall_s"] = time.time() - started
    print(json.dumps(result))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        for child in JOBS:
            if child.poll() is None:
                child.kill()

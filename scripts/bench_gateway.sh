#!/usr/bin/env bash
# Gateway load benchmark: 100 concurrent sessions chat with the gateway for 60 s over
# HTTP (half streamed) against the qwen3-tiny fixture while a learner trains beside it and each
# new weight version is installed through GatewayPolicy::install. Prints the 5xx count (target:
# zero), latency p50/p99, answers per version, then the same load without updates as the
# same-run reference and the ratios. Exits non-zero if any 5xx was seen.
#
# SESSIONS (default 100), SECS (default 60), UPDATE_SECS (pause between learner steps, default
# 5), REFERENCE=0 to skip the reference run.
set -euo pipefail
cd "$(dirname "$0")/.."
GATEWAY_BENCH_SESSIONS="${SESSIONS:-100}" \
GATEWAY_BENCH_SECS="${SECS:-60}" \
GATEWAY_BENCH_UPDATE_SECS="${UPDATE_SECS:-5}" \
GATEWAY_BENCH_REFERENCE="${REFERENCE:-1}" \
  cargo bench -q --bench gateway

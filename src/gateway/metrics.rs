//! Gateway counters and latency histograms, rendered in the Prometheus text exposition format
//! (version 0.0.4) for `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A cumulative latency histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation in seconds.
    pub fn observe(&self, secs: f64) {
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                self.counts[i].load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// Everything `/metrics` reports besides the session and sink counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests by (route, status code).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Errors by kind (the OpenAI error `type`/`code`).
    errors: Mutex<BTreeMap<String, u64>>,
    /// Prompt tokens fed to the model.
    pub prompt_tokens: AtomicU64,
    /// Tokens sampled.
    pub completion_tokens: AtomicU64,
    /// Streams the client abandoned before the end.
    pub streams_aborted: AtomicU64,
    /// Main turns recorded as abandoned (their client left before the answer was whole).
    pub turns_abandoned: AtomicU64,
    /// Requests being generated right now.
    pub in_flight: AtomicU64,
    /// Request latency to the response head.
    pub request_seconds: Histogram,
    /// Time from request to the first sampled token.
    pub first_token_seconds: Histogram,
    /// Time from request to the last sampled token.
    pub generation_seconds: Histogram,
}

impl Metrics {
    /// Counts a finished request.
    pub fn count_request(&self, route: &str, status: u16, secs: f64) {
        *self
            .requests
            .lock()
            .unwrap()
            .entry((route.to_string(), status))
            .or_default() += 1;
        self.request_seconds.observe(secs);
    }

    /// Counts an error answer.
    pub fn count_error(&self, kind: &str) {
        *self
            .errors
            .lock()
            .unwrap()
            .entry(kind.to_string())
            .or_default() += 1;
    }

    /// Answers with a 5xx status, every route together.
    pub fn server_errors(&self) -> u64 {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|((_, status), _)| *status >= 500)
            .map(|(_, n)| n)
            .sum()
    }

    /// Renders the gateway's own series; `extra` is appended (session and sink series).
    pub fn render(&self, extra: &[(&str, &str, &str, f64)]) -> String {
        let mut out = String::new();
        out.push_str("# HELP clawrl_gateway_requests_total HTTP requests by route and status.\n# TYPE clawrl_gateway_requests_total counter\n");
        for ((route, status), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(
                out,
                "clawrl_gateway_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str("# HELP clawrl_gateway_errors_total Error answers by kind.\n# TYPE clawrl_gateway_errors_total counter\n");
        for (kind, n) in self.errors.lock().unwrap().iter() {
            let _ = writeln!(out, "clawrl_gateway_errors_total{{kind=\"{kind}\"}} {n}");
        }
        let simple = [
            (
                "clawrl_gateway_prompt_tokens_total",
                "counter",
                "Prompt tokens fed to the model.",
                self.prompt_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                "clawrl_gateway_completion_tokens_total",
                "counter",
                "Tokens sampled.",
                self.completion_tokens.load(Ordering::Relaxed) as f64,
            ),
            (
                "clawrl_gateway_streams_aborted_total",
                "counter",
                "Streams the client left before the end.",
                self.streams_aborted.load(Ordering::Relaxed) as f64,
            ),
            (
                "clawrl_gateway_turns_abandoned_total",
                "counter",
                "Main turns whose client left before the answer was whole: recorded as abandoned, never trained on.",
                self.turns_abandoned.load(Ordering::Relaxed) as f64,
            ),
            (
                "clawrl_gateway_requests_in_flight",
                "gauge",
                "Completions being generated.",
                self.in_flight.load(Ordering::Relaxed) as f64,
            ),
        ];
        for (name, kind, help, v) in simple.iter().chain(extra.iter()) {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        self.request_seconds.render(
            &mut out,
            "clawrl_gateway_request_seconds",
            "Time from request to response head.",
        );
        self.first_token_seconds.render(
            &mut out,
            "clawrl_gateway_first_token_seconds",
            "Time from request to the first sampled token.",
        );
        self.generation_seconds.render(
            &mut out,
            "clawrl_gateway_generation_seconds",
            "Time from request to the last sampled token.",
        );
        out
    }
}

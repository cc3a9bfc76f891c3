//! The experiment's PRM as the RL job's judge: an OpenAI-compatible chat-completions endpoint
//! on a loopback port that answers each step-judge request with the rule-based vote of
//! [`super::prm`], as `\boxed{1}` or `\boxed{-1}`.
//!
//! The job's `openai` judge renders its `step_tool_call` prompt with [`TEMPLATE`], which sends
//! the step material as one JSON object (the task's question, the step's response, its tool
//! messages, the episode's messages before the step) instead of prose for a language model. A request this
//! endpoint cannot read (not JSON, a question outside the task set) is answered 400 with the
//! reason, which the judge records as a failed vote; it never guesses a vote.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::prm::judge_transcript;
use super::tasks::GenTask;

/// The job's `judge.prompts.step_tool_call`: the step material as one JSON object.
pub const TEMPLATE: &str =
    r#"{{ {"task": task, "step": step, "results": results, "messages": messages}|tojson }}"#;

/// The model name the job's judge sends (this endpoint serves no other).
pub const MODEL: &str = "rule-prm";

/// What [`TEMPLATE`] renders.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepRequest {
    task: String,
    /// The step's response text, read but not scored: the PRM judges what the calls did, not
    /// how they were written.
    #[serde(rename = "step")]
    _step: String,
    results: Vec<String>,
    messages: Vec<StepMessage>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StepMessage {
    role: String,
    content: String,
}

/// The votes an endpoint gave, and the requests it refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct VoteCounts {
    /// `\boxed{1}` answers.
    pub positive: u64,
    /// `\boxed{-1}` answers.
    pub negative: u64,
    /// Requests answered 400.
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    positive: AtomicU64,
    negative: AtomicU64,
    refused: AtomicU64,
}

struct Shared {
    /// Question text → task (the question is the episode's instruction).
    tasks: HashMap<String, GenTask>,
    counts: Counters,
}

/// A running endpoint; dropping it stops the server.
pub struct PrmEndpoint {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl PrmEndpoint {
    /// Serves the PRM of `tasks` on `127.0.0.1` at a port of the system's choosing.
    pub async fn start(tasks: &[GenTask]) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            tasks: tasks.iter().map(|t| (t.question(), t.clone())).collect(),
            counts: Counters::default(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!("the PRM endpoint stopped: {e}");
            }
        });
        Ok(Self {
            addr,
            shared,
            server,
        })
    }

    /// The base URL a job's `judge.endpoint` names.
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The votes so far.
    pub fn counts(&self) -> VoteCounts {
        let c = &self.shared.counts;
        VoteCounts {
            positive: c.positive.load(Ordering::Relaxed),
            negative: c.negative.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
        }
    }
}

impl Drop for PrmEndpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn refuse(shared: &Shared, why: String) -> Response {
    shared.counts.refused.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": {"message": why, "type": "invalid_request_error"}})),
    )
        .into_response()
}

/// The vote for one chat-completions request body, or why it cannot be read.
fn vote(shared: &Shared, body: &Value) -> Result<i8, String> {
    let prompt = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .ok_or("no user message with string content")?;
    let step: StepRequest = serde_json::from_str(prompt)
        .map_err(|e| format!("the prompt is not the step template's JSON: {e}"))?;
    let task = shared
        .tasks
        .get(&step.task)
        .ok_or_else(|| format!("unknown task {:?}", step.task))?;
    let messages: Vec<(&str, &str)> = step
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    Ok(judge_transcript(task, &messages, &step.results))
}

async fn complete(State(shared): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let v = match vote(&shared, &body) {
        Ok(v) => v,
        Err(why) => return refuse(&shared, why),
    };
    let counter = if v > 0 {
        &shared.counts.positive
    } else {
        &shared.counts.negative
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Json(json!({
        "id": "prm",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": format!("\\boxed{{{v}}}")},
            "finish_reason": "stop",
        }],
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::toolagent::tasks::Op;
    use clawrl::judge::{Material, PromptKind, PromptOverrides, PromptSet, StepMaterial};

    #[test]
    fn the_template_renders_what_the_endpoint_reads() {
        let t = GenTask {
            operands: [4, 7, 8],
            ops: [Op::Add, Op::Mul],
        };
        let shared = Shared {
            tasks: [(t.question(), t.clone())].into(),
            counts: Counters::default(),
        };
        let set = PromptSet::new(&PromptOverrides {
            step_tool_call: Some(TEMPLATE.into()),
            ..Default::default()
        })
        .unwrap();
        let material = |results: Vec<String>| StepMaterial {
            task: t.question(),
            history: String::new(),
            step_index: 0,
            step: String::new(),
            result: results.join("\n\n"),
            results,
            messages: Vec::new(),
        };
        let ask = |m: StepMaterial| {
            let text = set
                .render(PromptKind::StepToolCall, &Material::Step(m))
                .unwrap();
            vote(
                &shared,
                &json!({"messages": [{"role": "user", "content": text}]}),
            )
        };
        // 4+7*8: intermediate 56.
        let good = "exit code: 0\nstdout:\n56\nstderr:\n".to_string();
        assert_eq!(ask(material(vec![good])), Ok(1));
        let bad = "exit code: 1\nstdout:\nstderr:\nNameError <x> & 'y'\n".to_string();
        assert_eq!(ask(material(vec![bad])), Ok(-1));
        let mut other = material(vec![]);
        other.task = "what is 1+1+1 ?".into();
        assert!(ask(other).unwrap_err().contains("unknown task"));
        let prose = json!({"messages": [{"role": "user", "content": "Is this step good?"}]});
        assert!(vote(&shared, &prose).unwrap_err().contains("not the step"));
    }
}

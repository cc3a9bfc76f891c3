//! The `personal` job kind through the binary: `clawrl run` serves the fixture policy over the
//! gateway, sessions driven over HTTP are judged by a scripted judge from the user's next
//! message and trained on (batch 2), the gateway then answers with a newer weight version, side
//! turns give no samples, and at SIGTERM the job drains and prints a summary whose counts
//! balance, with judge records on disk.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::personal_run::{self, PersonalRun, SpecParams};

const KEY: &str = "sk-personal-test";

fn spec(out: &Path) -> String {
    personal_run::spec(
        out,
        &SpecParams {
            name: "personal-test",
            seed: 3,
            key: KEY,
            votes: 1,
            kl: 0.0,
        },
    )
}

async fn chat(
    http: &reqwest::Client,
    base: &str,
    messages: Value,
    headers: &[(&str, &str)],
) -> (Value, String) {
    personal_run::chat(http, base, KEY, messages, headers).await
}

fn content(body: &Value) -> String {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Three sessions of three main turns: the user praises turn 0, corrects turn 1, and ends the
/// session (turn 2 is kept without a next state, so unjudged); a side session runs too. Then
/// 6 judged turns with reward ±1 make 6 samples, 3 steps of 2, which the gateway installs: waits
/// for a side turn answered by a trained version and returns its body and version header.
async fn converse_until_trained(
    run: &PersonalRun,
    http: &reqwest::Client,
    base: &str,
) -> (Value, String) {
    for s in 0..3 {
        let sid = format!("user-{s}");
        let h = [("X-Session-Id", sid.as_str())];
        let mut messages = vec![json!({"role": "user", "content": format!("Explain item {s}.")})];
        let (b, _) = chat(http, base, json!(messages), &h).await;
        assert_eq!(b["session_id"], sid.as_str());
        messages.push(json!({"role": "assistant", "content": content(&b)}));
        messages.push(json!({"role": "user", "content": "Thanks, that helps!"}));
        let (b, _) = chat(http, base, json!(messages), &h).await;
        messages.push(json!({"role": "assistant", "content": content(&b)}));
        messages.push(json!({"role": "user", "content": "That is wrong, try again."}));
        let side = [("X-Session-Id", "side-task"), ("X-Turn-Type", "side")];
        chat(
            http,
            base,
            json!([{"role": "user", "content": "Summarize: thanks"}]),
            &side,
        )
        .await;
        let done = [("X-Session-Id", sid.as_str()), ("X-Session-Done", "1")];
        chat(http, base, json!(messages), &done).await;
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let probe = [("X-Turn-Type", "side")];
        let (b, h) = chat(
            http,
            base,
            json!([{"role": "user", "content": "hi"}]),
            &probe,
        )
        .await;
        if b["version"].as_u64().unwrap_or(0) >= 1 {
            return (b, h);
        }
        if Instant::now() > deadline {
            panic!("the gateway never served a trained version: {}", run.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs the job of spec `job` until the gateway serves a trained version (answering with its
/// version in the body and the header alike), then stops it as Ctrl-C does (drain and print the
/// summary): the JSON summary.
async fn train_then_stop(job: &Path, out: &Path) -> Value {
    let run = PersonalRun::start(job, out, Duration::from_secs(60));
    let base = run.base.clone();
    let http = reqwest::Client::new();
    let (body, header) = converse_until_trained(&run, &http, &base).await;
    assert_eq!(header, body["version"].as_u64().unwrap().to_string());
    run.stop()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_job_trains_from_gateway_turns_and_serves_the_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("personal.toml");
    std::fs::write(&job, spec(&out)).unwrap();
    let s = train_then_stop(&job, &out).await;
    assert_eq!(s["stopped_by"], "interrupted", "{s}");
    assert_eq!(s["balanced"], true, "{s}");
    let t = &s["agents"][0]["trainer"];
    assert!(t["steps"].as_u64().unwrap() >= 1, "{t}");
    assert_eq!(t["produced"], 6, "binary: the ±1 turns only: {t}");
    let c = &s["counts"];
    assert_eq!(c["turns"], 9, "main turns only: {c}");
    assert_eq!(c["sessions_started"], 3, "{c}");
    assert_eq!(s["turns_with_next_state"], 6, "{s}");
    assert_eq!(
        (c["judged"].as_u64(), c["unjudged"].as_u64()),
        (Some(6), Some(3))
    );
    assert_eq!(c["samples_submitted"], 6, "{c}");
    assert!(
        s["agents"][0]["gateway"]["version"].as_u64().unwrap() >= 1,
        "{s}"
    );

    // Records: a judge record per main turn, a sample record per sample, trainer steps; nothing
    // of the side session.
    let mut kinds = std::collections::HashMap::<String, usize>::new();
    for e in std::fs::read_dir(out.join("records")).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        assert!(
            !text.contains("side-task"),
            "a side turn reached the records"
        );
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            *kinds
                .entry(v["kind"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
    }
    assert_eq!(kinds.get("judge"), Some(&9), "{kinds:?}");
    assert_eq!(kinds.get("sample"), Some(&6), "{kinds:?}");
    assert!(
        kinds.get("trainer_step").copied().unwrap_or(0) >= 1,
        "{kinds:?}"
    );
}

/// With `policy.lora` the job trains a fresh adapter over the frozen checkpoint: each version it
/// publishes is the adapter alone, the gateway attaches it to the base it holds and serves it,
/// and the final checkpoint is a PEFT adapter directory (no base weights written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_personal_job_trains_the_adapter_alone_and_serves_its_versions() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("personal.toml");
    let text = personal_run::spec(
        &out,
        &SpecParams {
            name: "personal-lora",
            seed: 3,
            key: KEY,
            votes: 1,
            kl: 0.05,
        },
    );
    let lora = "lora = { r = 4, alpha = 8, targets = [\"q_proj\", \"v_proj\", \"down_proj\"] }";
    let text = text.replacen("[gateway]\n", &format!("{lora}\n[gateway]\n"), 1);
    assert!(text.contains(lora));
    std::fs::write(&job, text).unwrap();
    let s = train_then_stop(&job, &out).await;
    assert_eq!(s["balanced"], true, "{s}");
    let g = &s["agents"][0]["gateway"];
    assert_eq!(g["failed_installs"], 0, "{g}");
    assert!(g["switches"].as_u64().unwrap() >= 1, "{g}");
    // What travels is the adapter: r 4 on three targets of the fixture's blocks is about 15 KB,
    // against about 430 KB of whole f32 weights.
    let t = &s["agents"][0]["trainer"];
    let bytes = t["published_bytes"]
        .as_u64()
        .expect("a version was published");
    let ck = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny");
    let (cfg, model) =
        clawrl::model::load_model::<clawrl::CpuBackend>(&ck, &Default::default()).unwrap();
    let whole = clawrl::model::model_to_safetensors(&model, &cfg)
        .unwrap()
        .len() as u64;
    eprintln!("lora job: a version is {bytes} bytes; whole weights would be {whole} bytes");
    assert!(
        bytes * 20 < whole,
        "a version of {bytes} bytes is not an adapter alone: {t}"
    );

    // The final checkpoint is the trained adapter, as PEFT writes one.
    let final_ck = PathBuf::from(
        s["agents"][0]["final_checkpoint"]
            .as_str()
            .expect("a final checkpoint"),
    );
    assert!(final_ck.join("adapter_model.safetensors").exists());
    assert!(!final_ck.join("model.safetensors").exists());
    let adapter = clawrl::model::load_adapter(&final_ck, &cfg).unwrap();
    assert_eq!(adapter.weights.config.r, 4);
    assert_eq!(adapter.weights.tensors.len(), 3 * cfg.num_hidden_layers);
    // B starts at zero; trained, it is not.
    assert!(
        adapter
            .weights
            .tensors
            .values()
            .any(|(_, b)| b.iter().any(|&x| x != 0.0)),
        "the adapter did not train"
    );
}

/// The judge records (`kind = "judge"`) of judged turns under `records`: (session id, reward)
/// each.
fn judged(records: &Path) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(records).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            if v["kind"] == "judge" && v["record"]["unjudged"].is_null() {
                let r = &v["record"];
                out.push((
                    r["session_id"].as_str().unwrap().to_string(),
                    r["reward"].as_f64().expect("a judged turn's reward"),
                ));
            }
        }
    }
    out
}

/// One user's conversations with their own agent, under their own key: `sessions` sessions of
/// two main turns (the second message answers the first turn with `reply`, the session then
/// ends), all with the same session ids as the other user's. Returns once the agent serves a
/// trained version.
async fn user(base: &str, key: &str, agent: &str, reply: &str, sessions: usize) -> u64 {
    let http = reqwest::Client::new();
    let ask = |messages: Value, headers: Vec<(&'static str, String)>| {
        let mut req = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(key)
            .json(&json!({"model": agent, "messages": messages, "max_tokens": 6}));
        for (k, v) in headers {
            req = req.header(k, v);
        }
        async move {
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200, "{agent}");
            r.json::<Value>().await.unwrap()
        }
    };
    for s in 0..sessions {
        let sid = format!("shared-{s}");
        let mut messages = vec![json!({"role": "user", "content": format!("Plan day {s}.")})];
        let b = ask(json!(messages), vec![("X-Session-Id", sid.clone())]).await;
        assert_eq!(b["model"], agent, "{b}");
        messages.push(json!({"role": "assistant", "content": content(&b)}));
        messages.push(json!({"role": "user", "content": reply}));
        ask(
            json!(messages),
            vec![
                ("X-Session-Id", sid.clone()),
                ("X-Session-Done", "1".into()),
            ],
        )
        .await;
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let b = ask(
            json!([{"role": "user", "content": "hi"}]),
            vec![("X-Turn-Type", "side".into())],
        )
        .await;
        let v = b["version"].as_u64().unwrap_or(0);
        if v >= 1 {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{agent} never served a trained version"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `policy.agents`: one adapter per agent over one base. Two users talk to their own agents at
/// once, with the same session ids, one always pleased and one never: each agent's trainer
/// gets only its own user's turns (every judged reward of `alice` is +1, of `bob` −1), each
/// serves its own trained versions, and each writes its own records and adapter checkpoints.
/// A key scoped to `alice` cannot see `bob` or the checkpoint's id, and each user's dashboard
/// shows their own agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_users_train_their_own_adapters_at_once_and_never_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let job = dir.path().join("agents.toml");
    let text = personal_run::spec(
        &out,
        &SpecParams {
            name: "agents",
            seed: 5,
            key: KEY,
            votes: 1,
            kl: 0.0,
        },
    );
    let agents = "lora = { r = 4, alpha = 8, targets = [\"q_proj\", \"v_proj\"] }\n\
                  agents = [\"alice\", \"bob\"]\n";
    let text = text
        .replacen("[gateway]\n", &format!("{agents}[gateway]\n"), 1)
        .replacen("model_name = \"tiny\"\n", "", 1)
        .replacen(&format!("api_keys = [\"{KEY}\"]\n"), "", 1);
    let text = format!(
        "{text}\n[[gateway.scoped_keys]]\nkey = \"sk-alice\"\nmodels = [\"alice\"]\n\
         [[gateway.scoped_keys]]\nkey = \"sk-bob\"\nmodels = [\"bob\"]\n"
    );
    assert!(
        text.contains("agents = ") && !text.contains("model_name"),
        "{text}"
    );
    std::fs::write(&job, text).unwrap();
    let run = PersonalRun::start(&job, &out, Duration::from_secs(60));
    let base = run.base.clone();

    // To alice's key, bob and the checkpoint do not exist.
    let http = reqwest::Client::new();
    let models: Value = http
        .get(format!("{base}/v1/models"))
        .bearer_auth("sk-alice")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alice"], "{models}");
    for other in ["bob", "tiny", "qwen3-tiny"] {
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth("sk-alice")
            .json(&json!({"model": other, "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{other}");
    }

    // Both users at once, 2 sessions each: 2 judged turns, one step of 2, per agent.
    let (va, vb) = tokio::join!(
        user(&base, "sk-alice", "alice", "Thanks, perfect!", 2),
        user(&base, "sk-bob", "bob", "That is wrong.", 2),
    );
    assert!(va >= 1 && vb >= 1);

    // Each user's dashboard shows their own agent: its records (its trainer's steps) and the
    // version it serves. The other agent does not exist for their key.
    for (key, name, other) in [("sk-alice", "alice", "bob"), ("sk-bob", "bob", "alice")] {
        let data = |query: String| {
            http.get(format!("{base}/dashboard/data{query}"))
                .bearer_auth(key)
                .send()
        };
        let d: Value = data(String::new()).await.unwrap().json().await.unwrap();
        assert_eq!(d["live"]["model"], name, "{d}");
        // Its own user's 2 sessions and 4 main turns, not the other's.
        assert_eq!(d["live"]["sessions_started"], 2, "{d}");
        assert_eq!(d["live"]["main_turns"], 4, "{d}");
        assert!(d["live"]["version"].as_u64().unwrap() >= 1, "{d}");
        assert!(
            !d["steps"].as_array().unwrap().is_empty(),
            "{name}: no steps: {d}"
        );
        let own: Value = data(format!("?model={name}"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(own["steps"], d["steps"], "{name}");
        let r = data(format!("?model={other}")).await.unwrap();
        assert_eq!(
            r.status(),
            404,
            "{name}'s key asked for {other}'s dashboard"
        );
    }
    let s = run.stop();
    assert_eq!(s["balanced"], true, "{s}");
    let agents = s["agents"].as_array().unwrap();
    assert_eq!(agents.len(), 2, "{s}");
    for (a, name, reward) in [(&agents[0], "alice", 1.0), (&agents[1], "bob", -1.0)] {
        assert_eq!(a["model"], name, "{a}");
        let c = &a["counts"];
        assert_eq!(c["turns"], 4, "{name}: its own user's main turns only: {c}");
        assert_eq!(c["judged"], 2, "{name}: {c}");
        let t = &a["trainer"];
        assert_eq!(t["produced"], 2, "{name}: {t}");
        assert!(t["steps"].as_u64().unwrap() >= 1, "{name}: {t}");
        assert!(
            a["gateway"]["version"].as_u64().unwrap() >= 1,
            "{name}: {a}"
        );
        assert_eq!(a["gateway"]["failed_installs"], 0, "{name}: {a}");
        // Its records hold its own user's judgements alone.
        let records = out.join("agents").join(name).join("records");
        assert_eq!(Path::new(a["records_dir"].as_str().unwrap()), records);
        let judged = judged(&records);
        let rewarded: Vec<f64> = judged.iter().map(|(_, r)| *r).collect();
        assert_eq!(rewarded, vec![reward; 2], "{name}: {judged:?}");
        // Its final checkpoint is its own adapter.
        let ck = PathBuf::from(a["final_checkpoint"].as_str().expect("a final checkpoint"));
        assert!(
            ck.starts_with(out.join("agents").join(name)),
            "{}",
            ck.display()
        );
        assert!(ck.join("adapter_model.safetensors").exists());
        assert!(!ck.join("model.safetensors").exists());
    }
    assert_eq!(s["counts"]["turns"], 8, "{s}");
    // The two adapters trained apart: one pushed toward its answers, one away.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny");
    let cfg = clawrl::model::load_config(&fixture).unwrap();
    let adapter = |a: &Value| {
        let ck = PathBuf::from(a["final_checkpoint"].as_str().unwrap());
        clawrl::model::load_adapter(&ck, &cfg).unwrap().weights
    };
    let (wa, wb) = (adapter(&agents[0]), adapter(&agents[1]));
    assert_ne!(
        wa.tensors
            .values()
            .map(|(_, b)| b.clone())
            .collect::<Vec<_>>(),
        wb.tensors
            .values()
            .map(|(_, b)| b.clone())
            .collect::<Vec<_>>(),
        "the agents' adapters are the same"
    );
}

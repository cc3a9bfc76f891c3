//! OPD against the real fixture policy (`tests/fixtures/qwen3-tiny`): `s_enhanced` is the
//! original messages with the hint on the last user message, re-rendered with the same tools;
//! the teacher scores the *original* response tokens under it; the four-case combine follows.
//! Also the `model` judge backend over the generation engine, whose untrained output is noise:
//! every vote fails and the turn is recorded as unjudged, without stalling.

use std::path::PathBuf;
use std::sync::Arc;

use clawrl::judge::{
    EngineGenerator, Judge, ModelBackend, PromptOverrides, PromptSet, TeacherModel, TemplateKwargs,
    TurnMaterial, VoteSettings, HINT_PREFIX,
};
use clawrl::model::chat::parse_json_value;
use clawrl::model::{load_checkpoint, score_response, spawn_engine, Checkpoint, EngineOptions};
use clawrl::rl::{AdvantageWeights, CombineCase};
use clawrl::CpuBackend;

fn fixture() -> Checkpoint<CpuBackend> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3-tiny");
    load_checkpoint::<CpuBackend>(&dir, &Default::default()).expect("fixture loads")
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"run_shell","description":"Run a command","parameters":{"type":"object","properties":{"cmd":{"type":"string"}},"required":["cmd"]}}}]"#;

fn messages(last_user: &str) -> String {
    format!(
        r#"[{{"role":"system","content":"You are terse."}},{{"role":"user","content":"list the files"}},{{"role":"assistant","content":"ls"}},{{"role":"user","content":{}}}]"#,
        serde_json::to_string(last_user).unwrap()
    )
}

/// The teacher renders `s_enhanced` with the extra template variables `s_t` was served with
/// (a request's `chat_template_kwargs`), so a turn served without thinking is scored by a
/// teacher that did not think either.
#[test]
fn teacher_renders_with_the_turns_template_kwargs() {
    let mut ck = fixture();
    ck.chat_template = clawrl::model::ChatTemplate::new(
        concat!(
            "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}",
            "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
            "{%- if enable_thinking is defined and enable_thinking is false %}",
            "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
        ),
        "test template",
        Vec::new(),
    )
    .unwrap();
    let teacher = TeacherModel {
        model: &ck.model,
        template: &ck.chat_template,
        tokenizer: &ck.tokenizer,
    };
    let original = parse_json_value(&messages("now sort them"), "messages").unwrap();
    let hint = "Sort by size.";
    let response = ck
        .tokenizer
        .encode("ls -S", false)
        .unwrap()
        .get_ids()
        .to_vec();
    let kwargs: TemplateKwargs = serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
    let with = teacher
        .logprobs(&original, None, &kwargs, hint, &response)
        .unwrap();
    let by_hand = parse_json_value(
        &messages(&format!("now sort them{HINT_PREFIX}{hint}")),
        "messages",
    )
    .unwrap();
    let prompt = ck
        .chat_template
        .encode_with(&ck.tokenizer, &by_hand, None, &kwargs)
        .unwrap();
    assert!(
        prompt.text.ends_with("<think>\n\n</think>\n\n"),
        "{}",
        prompt.text
    );
    assert_eq!(with, score_response(&ck.model, &prompt.ids, &response));
    let without = teacher
        .logprobs(&original, None, &TemplateKwargs::new(), hint, &response)
        .unwrap();
    assert_ne!(with, without, "the variables change the teacher's context");
}

#[test]
fn teacher_scores_the_original_response_under_s_enhanced() {
    let ck = fixture();
    let teacher = TeacherModel {
        model: &ck.model,
        template: &ck.chat_template,
        tokenizer: &ck.tokenizer,
    };
    let tools = parse_json_value(TOOLS, "tools").unwrap();
    let original = parse_json_value(&messages("now sort them by size"), "messages").unwrap();
    let hint = "Use ls -S to sort by size.";
    let response = ck
        .tokenizer
        .encode("ls -S", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert!(!response.is_empty());
    let none = TemplateKwargs::new();

    let t = teacher
        .logprobs(&original, Some(&tools), &none, hint, &response)
        .unwrap();

    // Independent construction of s_enhanced, straight from docs/design.md §1's words.
    let by_hand = parse_json_value(
        &messages(&format!("now sort them by size{HINT_PREFIX}{hint}")),
        "messages",
    )
    .unwrap();
    let prompt = ck.encode_chat(&by_hand, Some(&tools)).unwrap();
    assert!(prompt.text.contains(
        "now sort them by size\n\n[user's hint / instruction]\nUse ls -S to sort by size."
    ));
    assert!(prompt.text.contains("run_shell"), "same tools rendered");
    assert_eq!(t, score_response(&ck.model, &prompt.ids, &response));
    assert_eq!(t.len(), response.len());

    // With a top-k: the same log-probs, and at every response position the k most likely ids of
    // the teacher under s_enhanced, most likely first (against the full distribution).
    let k = 5;
    let scored = teacher
        .score(&original, Some(&tools), &none, hint, &response, Some(k))
        .unwrap();
    assert_eq!(scored.logprobs, t);
    let top = scored.topk.expect("top-k asked for");
    assert_eq!((top.k as usize, top.ids.len()), (k, k * response.len()));
    let seq: Vec<i64> = prompt
        .ids
        .iter()
        .chain(&response)
        .map(|&i| i as i64)
        .collect();
    let n = seq.len() - 1;
    let logits = ck.model.forward(burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(seq[..n].to_vec(), [1, n]),
        &Default::default(),
    ));
    let full: Vec<f32> = burn::tensor::activation::log_softmax(logits, 2)
        .into_data()
        .to_vec()
        .unwrap();
    let vocab = ck.model.vocab_size();
    for i in 0..response.len() {
        let row = &full[(prompt.ids.len() - 1 + i) * vocab..][..vocab];
        let mut best: Vec<usize> = (0..vocab).collect();
        best.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
        for j in 0..k {
            let (id, lp) = (top.ids[i * k + j] as usize, top.logprobs[i * k + j]);
            assert!(
                (lp - row[id]).abs() < 1e-5,
                "position {i}: {lp} vs {}",
                row[id]
            );
            assert!((lp - row[best[j]]).abs() < 1e-5, "position {i} rank {j}");
        }
    }
    assert!(teacher
        .score(
            &original,
            Some(&tools),
            &none,
            hint,
            &response,
            Some(vocab + 1)
        )
        .unwrap_err()
        .to_string()
        .contains("method.topk"));

    // The old policy under s_t sees no hint, and the hint changes the conditioning.
    let old_prompt = ck.encode_chat(&original, Some(&tools)).unwrap();
    let old = score_response(&ck.model, &old_prompt.ids, &response);
    assert_ne!(t, old);

    // Four-case combine with the teacher: reward -1 and a hint → both terms.
    let w = AdvantageWeights {
        w_binary: 1.0,
        w_opd: 0.5,
    };
    let s = teacher
        .combined_sample(w, -1, Some(hint), &original, Some(&tools), &response, &old)
        .unwrap()
        .unwrap();
    assert_eq!(s.case, CombineCase::Both);
    let want: Vec<f32> = t
        .iter()
        .zip(&old)
        .map(|(t, o)| -1.0 + 0.5 * (t - o))
        .collect();
    assert_eq!(s.advantages, want);
    // Reward 0 with a hint → OPD only; no hint and reward 0 → no sample.
    let s = teacher
        .combined_sample(w, 0, Some(hint), &original, Some(&tools), &response, &old)
        .unwrap()
        .unwrap();
    assert_eq!(s.case, CombineCase::OpdOnly);
    assert_eq!(
        teacher
            .combined_sample(w, 0, None, &original, Some(&tools), &response, &old)
            .unwrap(),
        None
    );

    // Bad input is refused with a reason.
    let e = teacher
        .logprobs(&original, Some(&tools), &none, hint, &[])
        .unwrap_err();
    assert!(e.to_string().contains("empty response"));
    let e = teacher
        .logprobs(&original, Some(&tools), &none, hint, &[u32::MAX])
        .unwrap_err();
    assert!(
        e.to_string().contains("outside the teacher's vocabulary"),
        "{e}"
    );
    assert!(teacher
        .combined_sample(w, 1, Some(hint), &original, None, &response, &old[..1])
        .is_err());
}

#[tokio::test]
async fn a_noise_model_judge_gives_failed_votes_and_an_unjudged_turn() {
    let ck = fixture();
    let stop = ck.stop_token_ids();
    let engine = spawn_engine(
        Arc::new(ck.model),
        Some(Arc::new(ck.tokenizer.clone())),
        EngineOptions::default(),
    );
    let generator =
        EngineGenerator::new(engine, ck.chat_template, Arc::new(ck.tokenizer), stop, 11);
    let settings = VoteSettings {
        m: 3,
        hint_m: 2,
        max_tokens: 12,
        hint_max_tokens: 12,
        ..VoteSettings::default()
    };
    // The fixture's context is 512 tokens: short prompts so generation runs and yields noise.
    let prompts = PromptSet::new(&PromptOverrides {
        personal_eval: Some("Reply: {{ response }}\nNext ({{ next_state_role }}): {{ next_state }}\nVerdict \\boxed{1|-1|0}:".into()),
        hint: Some("Reply: {{ response }}\nNext ({{ next_state_role }}): {{ next_state }}\nHint?".into()),
        ..Default::default()
    })
    .unwrap();
    let judge = Judge::new(
        Arc::new(ModelBackend::new(Arc::new(generator))),
        Arc::new(prompts),
        settings,
    )
    .unwrap();
    let j = judge
        .judge_turn(
            TurnMaterial {
                response: "ls".into(),
                next_state: "no, hidden files too".into(),
                next_state_role: "user".into(),
            },
            true,
        )
        .await;
    assert_eq!(j.votes.len() + j.hint_votes.len(), 5);
    assert!(j
        .votes
        .iter()
        .chain(&j.hint_votes)
        .all(|v| v.score.is_none() && v.error.is_some()));
    assert_eq!((j.reward, j.hint.clone()), (0, None));
    let reason = j.unjudged.clone().expect("unjudged");
    assert!(reason.contains("no \\boxed"), "{reason}");
    let record = j.record("s", 0, None);
    assert!(!record.hint_accepted && record.unjudged.is_some());
}

//! The pure part of hindsight-guided on-policy distillation (OPD): building `s_enhanced`.
//!
//! docs/design.md §1: append `"\n\n[user's hint / instruction]\n" + hint` to the content of the last
//! `user` message of `s_t` (the last message if there is no user message), then re-render with
//! the same chat template and tools. Messages and tools are [`minijinja::Value`]s, the form the
//! chat template renders (`crate::model::chat`), so key order, tool schemas and every other field
//! pass through untouched; only the one content changes.
//!
//! Content forms: a string gets the suffix appended; a list of content parts gets it appended to
//! its last `text` part (or a new `{"type": "text", "text": suffix}` part when the last part is
//! not text); a missing or `null` content becomes the suffix alone (the hint text minus nothing:
//! `"\n\n[user's hint / instruction]\n" + hint`, exactly).

use minijinja::value::ValueKind;
use minijinja::Value;
use thiserror::Error;

/// The text inserted before the hint.
pub const HINT_PREFIX: &str = "\n\n[user's hint / instruction]\n";

/// Errors building `s_enhanced`.
#[derive(Debug, Error, PartialEq)]
pub enum OpdError {
    /// The message list is not a non-empty list of objects.
    #[error("OPD: messages must be a non-empty list of message objects ({0})")]
    BadMessages(String),
    /// The chosen message's content has a shape we cannot append to.
    #[error("OPD: message {index} has content of kind {kind}, expected a string, a list of parts, or null")]
    BadContent {
        /// Message index.
        index: usize,
        /// The content's kind.
        kind: String,
    },
    /// The hint is empty after trimming.
    #[error("OPD: empty hint")]
    EmptyHint,
}

/// The index of the message that receives the hint: the last `user` message, else the last one.
pub fn hint_target(messages: &Value) -> Result<usize, OpdError> {
    if messages.kind() != ValueKind::Seq {
        return Err(OpdError::BadMessages(format!("got {}", messages.kind())));
    }
    let n = messages.len().unwrap_or(0);
    if n == 0 {
        return Err(OpdError::BadMessages("empty list".into()));
    }
    let mut last_user = None;
    for i in 0..n {
        let m = messages
            .get_item_by_index(i)
            .map_err(|e| OpdError::BadMessages(e.to_string()))?;
        if m.kind() != ValueKind::Map {
            return Err(OpdError::BadMessages(format!(
                "message {i} is a {}",
                m.kind()
            )));
        }
        if m.get_attr("role")
            .ok()
            .and_then(|r| r.as_str().map(|s| s == "user"))
            == Some(true)
        {
            last_user = Some(i);
        }
    }
    Ok(last_user.unwrap_or(n - 1))
}

/// Builds the message list of `s_enhanced`: a copy of `messages` in which the target message's
/// content has `HINT_PREFIX + hint` appended. The hint is used as given (the judge already trimmed
/// it); an empty or whitespace-only hint is refused.
pub fn enhance_messages(messages: &Value, hint: &str) -> Result<Value, OpdError> {
    if hint.trim().is_empty() {
        return Err(OpdError::EmptyHint);
    }
    let target = hint_target(messages)?;
    let suffix = format!("{HINT_PREFIX}{hint}");
    let n = messages.len().unwrap_or(0);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let m = messages
            .get_item_by_index(i)
            .map_err(|e| OpdError::BadMessages(e.to_string()))?;
        if i != target {
            out.push(m);
            continue;
        }
        let mut fields: Vec<(Value, Value)> = Vec::new();
        let mut saw_content = false;
        for key in m
            .try_iter()
            .map_err(|e| OpdError::BadMessages(e.to_string()))?
        {
            let v = m
                .get_item(&key)
                .map_err(|e| OpdError::BadMessages(e.to_string()))?;
            if key.as_str() == Some("content") {
                saw_content = true;
                fields.push((key, append_to_content(i, &v, &suffix)?));
            } else {
                fields.push((key, v));
            }
        }
        if !saw_content {
            fields.push((Value::from("content"), Value::from(suffix.clone())));
        }
        out.push(Value::from_iter(fields));
    }
    Ok(Value::from(out))
}

fn append_to_content(index: usize, content: &Value, suffix: &str) -> Result<Value, OpdError> {
    match content.kind() {
        ValueKind::String => Ok(Value::from(format!(
            "{}{suffix}",
            content.as_str().unwrap_or("")
        ))),
        ValueKind::None | ValueKind::Undefined => Ok(Value::from(suffix)),
        ValueKind::Seq => {
            let parts: Vec<Value> = content
                .try_iter()
                .map_err(|e| OpdError::BadMessages(e.to_string()))?
                .collect();
            let mut parts = parts;
            let last_is_text = parts.last().is_some_and(|p| {
                p.get_attr("type")
                    .ok()
                    .and_then(|t| t.as_str().map(|t| t == "text"))
                    == Some(true)
                    && p.get_attr("text")
                        .ok()
                        .is_some_and(|t| t.kind() == ValueKind::String)
            });
            if last_is_text {
                let last = parts.pop().expect("checked non-empty");
                let mut fields: Vec<(Value, Value)> = Vec::new();
                for key in last
                    .try_iter()
                    .map_err(|e| OpdError::BadMessages(e.to_string()))?
                {
                    let v = last
                        .get_item(&key)
                        .map_err(|e| OpdError::BadMessages(e.to_string()))?;
                    if key.as_str() == Some("text") {
                        fields.push((
                            key,
                            Value::from(format!("{}{suffix}", v.as_str().unwrap_or(""))),
                        ));
                    } else {
                        fields.push((key, v));
                    }
                }
                parts.push(Value::from_iter(fields));
            } else {
                parts.push(Value::from_iter([
                    (Value::from("type"), Value::from("text")),
                    (Value::from("text"), Value::from(suffix)),
                ]));
            }
            Ok(Value::from(parts))
        }
        other => Err(OpdError::BadContent {
            index,
            kind: other.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(json: &str) -> Value {
        let parsed: serde_json::Value = serde_json::from_str(json).unwrap();
        Value::from_serialize(&parsed)
    }

    fn json(v: &Value) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    #[test]
    fn hint_goes_on_the_last_user_message() {
        let msgs = v(r#"[
            {"role":"system","content":"sys"},
            {"role":"user","content":"list files"},
            {"role":"assistant","content":"ls"},
            {"role":"user","content":"now sort them"},
            {"role":"assistant","content":"","tool_calls":[{"function":{"name":"sh","arguments":"{}"}}]},
            {"role":"tool","content":"a b"}
        ]"#);
        let out = json(&enhance_messages(&msgs, "Sort by size, largest first.").unwrap());
        assert_eq!(
            out[3]["content"],
            "now sort them\n\n[user's hint / instruction]\nSort by size, largest first."
        );
        // Everything else is untouched.
        let before = json(&msgs);
        for i in [0, 1, 2, 4, 5] {
            assert_eq!(out[i], before[i], "message {i}");
        }
    }

    #[test]
    fn without_a_user_message_the_last_message_gets_it() {
        let msgs = v(r#"[{"role":"system","content":"sys"},{"role":"tool","content":"out"}]"#);
        let out = json(&enhance_messages(&msgs, "retry with -v").unwrap());
        assert_eq!(
            out[1]["content"],
            "out\n\n[user's hint / instruction]\nretry with -v"
        );
        assert_eq!(out[0]["content"], "sys");
    }

    #[test]
    fn content_parts_null_and_missing_content() {
        let parts = v(
            r#"[{"role":"user","content":[{"type":"image","url":"x"},{"type":"text","text":"what is it"}]}]"#,
        );
        let out = json(&enhance_messages(&parts, "be brief").unwrap());
        assert_eq!(
            out[0]["content"][1]["text"],
            "what is it\n\n[user's hint / instruction]\nbe brief"
        );
        assert_eq!(out[0]["content"][0]["type"], "image");

        let image_last = v(r#"[{"role":"user","content":[{"type":"image","url":"x"}]}]"#);
        let out = json(&enhance_messages(&image_last, "be brief").unwrap());
        assert_eq!(
            out[0]["content"][1],
            serde_json::json!({"type":"text","text":"\n\n[user's hint / instruction]\nbe brief"})
        );

        let null = v(r#"[{"role":"user","content":null,"name":"u"}]"#);
        let out = json(&enhance_messages(&null, "hint").unwrap());
        assert_eq!(out[0]["content"], "\n\n[user's hint / instruction]\nhint");
        assert_eq!(out[0]["name"], "u");

        let missing = v(r#"[{"role":"user"}]"#);
        let out = json(&enhance_messages(&missing, "hint").unwrap());
        assert_eq!(out[0]["content"], "\n\n[user's hint / instruction]\nhint");
    }

    #[test]
    fn key_order_is_kept() {
        let msg = Value::from_iter([
            (Value::from("role"), Value::from("user")),
            (Value::from("content"), Value::from("q")),
            (Value::from("zeta"), Value::from(1)),
            (Value::from("alpha"), Value::from(2)),
        ]);
        let msgs = Value::from(vec![msg]);
        let out = enhance_messages(&msgs, "hint").unwrap();
        let m = out.get_item_by_index(0).unwrap();
        let keys: Vec<String> = m.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, vec!["role", "content", "zeta", "alpha"]);
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(matches!(
            enhance_messages(&v("[]"), "hint"),
            Err(OpdError::BadMessages(_))
        ));
        assert!(matches!(
            enhance_messages(&v(r#"{"role":"user"}"#), "hint"),
            Err(OpdError::BadMessages(_))
        ));
        assert!(matches!(
            enhance_messages(&v(r#"["text"]"#), "hint"),
            Err(OpdError::BadMessages(_))
        ));
        assert!(matches!(
            enhance_messages(&v(r#"[{"role":"user","content":5}]"#), "hint"),
            Err(OpdError::BadContent { index: 0, .. })
        ));
        assert_eq!(
            enhance_messages(&v(r#"[{"role":"user","content":"q"}]"#), "  "),
            Err(OpdError::EmptyHint)
        );
    }
}

//! Session inference: whether a request that names no session extends a turn the gateway
//! served. Pure: it compares messages and nothing else; [`super::session::SessionTable::infer`]
//! applies it to a key's open sessions.
//!
//! Agents that send no session header resend the whole conversation each time. A request
//! *extends* a served turn when:
//! - one of its messages is an assistant message equal to the turn's response: same text and
//!   the same tool calls, compared after normalising (a string content equals a list of text
//!   parts that join to it, a null or missing content is `""`; a tool call is compared by
//!   function name and parsed JSON arguments, and by id when both sides carry one);
//! - every message before it appears in the turn's prompt, in order (the client may have
//!   dropped prompt messages, as OpenClaw drops its previous internal-context user message, but
//!   it may not add or change any);
//! - at least one message follows it and none of those is an assistant message: they are the
//!   turn's next state (user and tool messages, as the client sent them).
//!
//! Every turn a request extends agrees with all of its messages before the response, so when
//! it extends several, the one whose prompt it dropped the fewest messages of wins
//! ([`Extension::rank`]); the session table breaks what is left by recency.

use serde_json::Value;

/// One tool call, normalised.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    id: Option<String>,
    name: String,
    /// The arguments parsed from their JSON text (kept as the string when not JSON).
    arguments: Value,
}

/// One message, normalised for comparison: role, text, tool calls and the tool-call id it
/// answers. Other keys (`name`, `reasoning_content`) are not compared.
#[derive(Debug, Clone, PartialEq)]
pub struct Msg {
    role: String,
    text: String,
    calls: Vec<Call>,
    tool_call_id: Option<String>,
}

fn text_of(content: Option<&Value>) -> String {
    match content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match p.get("text").and_then(Value::as_str) {
                Some(t) if p.get("type").and_then(Value::as_str) == Some("text") => t.to_string(),
                _ => p.to_string(),
            })
            .collect(),
        Some(other) => other.to_string(),
    }
}

fn str_of(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_string)
}

impl Msg {
    /// Normalises an OpenAI chat message (anything else normalises to an empty message).
    pub fn from_json(m: &Value) -> Self {
        let calls =
            m.get("tool_calls")
                .and_then(Value::as_array)
                .map(|calls| {
                    calls
                        .iter()
                        .map(|c| {
                            let f = c.get("function");
                            let arguments = match f.and_then(|f| f.get("arguments")) {
                                Some(Value::String(s)) => serde_json::from_str(s)
                                    .unwrap_or_else(|_| Value::String(s.clone())),
                                Some(v) => v.clone(),
                                None => Value::Null,
                            };
                            Call {
                                id: str_of(c.get("id")),
                                name: str_of(f.and_then(|f| f.get("name"))).unwrap_or_default(),
                                arguments,
                            }
                        })
                        .collect()
                })
                .unwrap_or_default();
        Self {
            role: str_of(m.get("role")).unwrap_or_default(),
            text: text_of(m.get("content")),
            calls,
            tool_call_id: str_of(m.get("tool_call_id")),
        }
    }

    /// Whether two messages say the same: tool-call ids are compared only when both carry one.
    pub fn same(&self, other: &Msg) -> bool {
        self.role == other.role
            && self.text == other.text
            && self.tool_call_id == other.tool_call_id
            && self.calls.len() == other.calls.len()
            && self.calls.iter().zip(&other.calls).all(|(a, b)| {
                a.name == b.name
                    && a.arguments == b.arguments
                    && match (&a.id, &b.id) {
                        (Some(x), Some(y)) => x == y,
                        _ => true,
                    }
            })
    }
}

/// What a served turn is compared by: its prompt messages and its response, normalised.
#[derive(Debug, Clone, PartialEq)]
pub struct Transcript {
    prompt: Vec<Msg>,
    response: Msg,
}

impl Transcript {
    /// The transcript of a turn served for `prompt` that answered `response`.
    pub fn new(prompt: &[Value], response: &Value) -> Self {
        Self {
            prompt: prompt.iter().map(Msg::from_json).collect(),
            response: Msg::from_json(response),
        }
    }
}

/// How a request extends a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extension {
    /// The index of the request message that is the turn's response; the messages after it are
    /// the next state.
    pub at: usize,
    /// Prompt messages the request dropped before `at`.
    pub missing: usize,
}

impl Extension {
    /// The ranking key, higher better: fewer prompt messages dropped.
    pub fn rank(&self) -> std::cmp::Reverse<usize> {
        std::cmp::Reverse(self.missing)
    }
}

/// How `request` extends the turn of `t`, if it does (see the module rules).
pub fn extends(t: &Transcript, request: &[Msg]) -> Option<Extension> {
    // Nothing after the response may be an assistant message, so it is the last one, and the
    // next state after it must not be empty.
    let at = request.iter().rposition(|m| m.role == "assistant")?;
    if at + 1 >= request.len() || !request[at].same(&t.response) {
        return None;
    }
    subsequence(&request[..at], &t.prompt)?;
    Some(Extension {
        at,
        missing: t.prompt.len() - at,
    })
}

/// `Some` when every message of `part` appears in `whole`, in order (greedy matching finds an
/// embedding whenever one exists).
fn subsequence(part: &[Msg], whole: &[Msg]) -> Option<()> {
    let mut rest = whole.iter();
    for m in part {
        rest.find(|w| w.same(m))?;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msgs(v: &[Value]) -> Vec<Msg> {
        v.iter().map(Msg::from_json).collect()
    }

    #[test]
    fn content_parts_and_argument_text_are_normalised() {
        let a = Msg::from_json(&json!({"role": "user", "content": "hello world"}));
        let b = Msg::from_json(&json!({"role": "user", "content": [
            {"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}));
        assert!(a.same(&b));
        let served = Msg::from_json(
            &json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "exec", "arguments": "{\"cmd\":\"ls\",\"n\":1}"}}]}),
        );
        let resent = Msg::from_json(&json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "exec", "arguments": "{\"n\": 1, \"cmd\": \"ls\"}"}}]}));
        let no_id = Msg::from_json(&json!({"role": "assistant", "tool_calls": [
            {"function": {"name": "exec", "arguments": {"cmd": "ls", "n": 1}}}]}));
        let other_id = Msg::from_json(&json!({"role": "assistant", "tool_calls": [
            {"id": "call_2", "function": {"name": "exec", "arguments": {"cmd": "ls", "n": 1}}}]}));
        let other_args = Msg::from_json(&json!({"role": "assistant", "tool_calls": [
            {"id": "call_1", "function": {"name": "exec", "arguments": "{\"cmd\":\"pwd\"}"}}]}));
        assert!(served.same(&resent));
        assert!(served.same(&no_id));
        assert!(!served.same(&other_id));
        assert!(!served.same(&other_args));
    }

    #[test]
    fn the_prior_messages_may_drop_prompt_messages_but_not_add_or_reorder() {
        let sys = json!({"role": "system", "content": "sys"});
        let u1 = json!({"role": "user", "content": "u1"});
        let ctx = json!({"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> x"});
        let a1 = json!({"role": "assistant", "content": "a1"});
        let u2 = json!({"role": "user", "content": "u2"});
        let t = Transcript::new(&[sys.clone(), u1.clone(), ctx], &a1);
        let req = msgs(&[sys.clone(), u1.clone(), a1.clone(), u2.clone()]);
        assert_eq!(extends(&t, &req), Some(Extension { at: 2, missing: 1 }));
        // An added or reordered earlier message breaks the match.
        let added = json!({"role": "user", "content": "new"});
        let req = msgs(&[sys.clone(), added, u1.clone(), a1.clone(), u2.clone()]);
        assert_eq!(extends(&t, &req), None);
        let req = msgs(&[u1.clone(), sys.clone(), a1.clone(), u2.clone()]);
        assert_eq!(extends(&t, &req), None);
        // Another response, nothing after it, or an assistant message after it: no match.
        let other = json!({"role": "assistant", "content": "a2"});
        assert_eq!(
            extends(&t, &msgs(&[sys.clone(), u1.clone(), other, u2.clone()])),
            None
        );
        assert_eq!(
            extends(&t, &msgs(&[sys.clone(), u1.clone(), a1.clone()])),
            None
        );
        let later = json!({"role": "assistant", "content": "later"});
        assert_eq!(extends(&t, &msgs(&[sys, u1, a1, u2, later])), None);
    }
}

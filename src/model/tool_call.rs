//! Parser for Qwen-style tool calls in generated text:
//! `<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>`, any number of them, with
//! ordinary text around. Malformed calls are errors that say which call and what is wrong.

use serde_json::Value;

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function name.
    pub name: String,
    /// The arguments object (a JSON-encoded string of an object is decoded).
    pub arguments: Value,
    /// The JSON text between the tags, trimmed.
    pub raw: String,
}

/// Generated text split into its plain content and its tool calls.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedResponse {
    /// The text outside the tool-call blocks, trimmed.
    pub content: String,
    /// The calls, in order.
    pub tool_calls: Vec<ToolCall>,
}

/// A malformed tool call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolCallError {
    /// `<tool_call>` without a closing `</tool_call>`.
    #[error("tool call {index}: <tool_call> at byte {offset} is never closed by </tool_call>")]
    Unterminated {
        /// 0-based call number.
        index: usize,
        /// Byte offset of the opening tag.
        offset: usize,
    },
    /// `</tool_call>` without an opening tag.
    #[error("stray </tool_call> at byte {offset} without an opening <tool_call>")]
    StrayClose {
        /// Byte offset of the closing tag.
        offset: usize,
    },
    /// The body is not JSON.
    #[error("tool call {index}: body is not valid JSON ({message}): {body:?}")]
    InvalidJson {
        /// 0-based call number.
        index: usize,
        /// The JSON parser's message.
        message: String,
        /// The body text.
        body: String,
    },
    /// The JSON lacks a string `name`, or has an unusable `arguments`.
    #[error("tool call {index}: {reason}")]
    BadShape {
        /// 0-based call number.
        index: usize,
        /// What is wrong.
        reason: String,
    },
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Parses every tool call in `text`.
pub fn parse_tool_calls(text: &str) -> Result<ParsedResponse, ToolCallError> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    let mut base = 0;
    loop {
        let open = rest.find(OPEN);
        let close = rest.find(CLOSE);
        match (open, close) {
            (None, None) => {
                content.push_str(rest);
                break;
            }
            (None, Some(c)) => return Err(ToolCallError::StrayClose { offset: base + c }),
            (Some(o), Some(c)) if c < o => {
                return Err(ToolCallError::StrayClose { offset: base + c })
            }
            (Some(o), None) => {
                return Err(ToolCallError::Unterminated {
                    index: calls.len(),
                    offset: base + o,
                })
            }
            (Some(o), Some(c)) => {
                let body = &rest[o + OPEN.len()..c];
                if body.contains(OPEN) {
                    return Err(ToolCallError::Unterminated {
                        index: calls.len(),
                        offset: base + o,
                    });
                }
                content.push_str(&rest[..o]);
                calls.push(parse_one(calls.len(), body.trim())?);
                let next = c + CLOSE.len();
                base += next;
                rest = &rest[next..];
            }
        }
    }
    Ok(ParsedResponse {
        content: content.trim().to_string(),
        tool_calls: calls,
    })
}

fn parse_one(index: usize, body: &str) -> Result<ToolCall, ToolCallError> {
    let v: Value = serde_json::from_str(body).map_err(|e| ToolCallError::InvalidJson {
        index,
        message: e.to_string(),
        body: body.to_string(),
    })?;
    let obj = v.as_object().ok_or_else(|| ToolCallError::BadShape {
        index,
        reason: "body is not a JSON object".into(),
    })?;
    let name = obj
        .get("name")
        .and_then(|n| n.as_str())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ToolCallError::BadShape {
            index,
            reason: "missing a non-empty string \"name\"".into(),
        })?;
    let arguments = match obj.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Value::Object(m),
            _ => {
                return Err(ToolCallError::BadShape {
                    index,
                    reason: format!("\"arguments\" is a string that is not a JSON object: {s:?}"),
                })
            }
        },
        Some(other) => {
            return Err(ToolCallError::BadShape {
                index,
                reason: format!("\"arguments\" must be an object, got {other}"),
            })
        }
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
        raw: body.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_calls_and_content() {
        let t = "Let me look.\n<tool_call>\n{\"name\": \"shell_exec\", \"arguments\": {\"command\": \"ls -la\"}}\n</tool_call>\n<tool_call>{\"name\":\"read\",\"arguments\":\"{\\\"path\\\": \\\"a\\\"}\"}</tool_call>";
        let p = parse_tool_calls(t).unwrap();
        assert_eq!(p.content, "Let me look.");
        assert_eq!(p.tool_calls.len(), 2);
        assert_eq!(p.tool_calls[0].name, "shell_exec");
        assert_eq!(p.tool_calls[0].arguments["command"], "ls -la");
        assert_eq!(p.tool_calls[1].arguments["path"], "a");
        assert_eq!(parse_tool_calls("plain").unwrap().tool_calls, vec![]);
    }

    #[test]
    fn malformed_calls_are_clear_errors() {
        let e = parse_tool_calls("<tool_call>{\"name\": \"x\"").unwrap_err();
        assert!(
            matches!(e, ToolCallError::Unterminated { index: 0, .. }),
            "{e}"
        );
        let e = parse_tool_calls("<tool_call>{name: x}</tool_call>").unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e = parse_tool_calls("<tool_call>{\"arguments\": {}}</tool_call>").unwrap_err();
        assert!(e.to_string().contains("\"name\""), "{e}");
        let e = parse_tool_calls("<tool_call>{\"name\":\"a\",\"arguments\":[1]}</tool_call>")
            .unwrap_err();
        assert!(e.to_string().contains("must be an object"), "{e}");
        let e = parse_tool_calls("x</tool_call>").unwrap_err();
        assert!(matches!(e, ToolCallError::StrayClose { offset: 1 }), "{e}");
    }
}

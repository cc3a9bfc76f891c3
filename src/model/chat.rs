//! Chat templates: renders a message list (and tool definitions) into prompt text exactly as
//! Hugging Face `apply_chat_template` does, then tokenizes it.
//!
//! Hugging Face renders with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, a sandbox) and
//! adds a `tojson` filter that is Python's `json.dumps(ensure_ascii=False)` (separators `", "` and
//! `": "`, key order kept) and a `raise_exception` function. This module sets up `minijinja` the
//! same way, with Python string/dict methods from `minijinja-contrib`'s pycompat. Messages and
//! tools are passed as [`minijinja::Value`]s, parsed from JSON text (keys keep their order, as
//! Python's `json.load` does) or built from any `Serialize` value.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// A failure to parse inputs or render a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template source does not compile.
    #[error("chat template from {origin} does not parse: {message}")]
    Parse {
        /// Where the template came from.
        origin: String,
        /// The parser's message.
        message: String,
    },
    /// Rendering failed (including `raise_exception` in the template).
    #[error("chat template from {origin} failed to render: {message}")]
    Render {
        /// Where the template came from.
        origin: String,
        /// The renderer's message, with its cause chain.
        message: String,
    },
    /// Messages or tools JSON is malformed.
    #[error("{what}: {message}")]
    Input {
        /// What was being read (e.g. the file name).
        what: String,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer failed on the rendered prompt.
    #[error("tokenizer: {0}")]
    Tokenize(String),
}

/// A rendered and tokenized prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The prompt text as the template renders it.
    pub text: String,
    /// Its token ids (no special tokens added by the tokenizer, as `apply_chat_template`).
    pub ids: Vec<u32>,
}

/// A compiled chat template together with the special-token strings it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    source: String,
    origin: String,
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` from `tokenizer_config.json`.
    special_tokens: Vec<(String, String)>,
}

impl Clone for ChatTemplate {
    fn clone(&self) -> Self {
        Self::new(&self.source, &self.origin, self.special_tokens.clone())
            .expect("an already compiled template compiles again")
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `origin` names where it came from (used in errors);
    /// `special_tokens` are exposed to the template as variables (e.g. `eos_token`).
    pub fn new(
        source: &str,
        origin: &str,
        special_tokens: Vec<(String, String)>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Parse {
                origin: origin.to_string(),
                message: error_chain(&e),
            })?;
        Ok(Self {
            source: source.to_string(),
            origin: origin.to_string(),
            env,
            special_tokens,
        })
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template came from (a file name).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The special-token variables the template sees.
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// Renders `messages` (a list of `{role, content, tool_calls?, ...}`) and optional `tools`
    /// (a list of tool schemas) into prompt text. `extra` adds template variables (e.g.
    /// `enable_thinking`).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &[(&str, Value)],
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("template was added in new");
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), messages.clone()),
            ("tools".into(), tools.cloned().unwrap_or(Value::from(()))),
            (
                "add_generation_prompt".into(),
                Value::from(add_generation_prompt),
            ),
        ];
        for (k, v) in &self.special_tokens {
            ctx.push((k.clone(), Value::from(v.as_str())));
        }
        for (k, v) in extra {
            ctx.push((k.to_string(), v.clone()));
        }
        let ctx: Value = ctx.into_iter().collect();
        tmpl.render(ctx).map_err(|e| ChatError::Render {
            origin: self.origin.clone(),
            message: error_chain(&e),
        })
    }

    /// Renders and tokenizes: messages (+ tools) → prompt text → ids.
    pub fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        messages: &Value,
        tools: Option<&Value>,
    ) -> Result<Prompt, ChatError> {
        self.encode_with(tokenizer, messages, tools, &serde_json::Map::new())
    }

    /// [`ChatTemplate::encode`] with extra template variables (`chat_template_kwargs`).
    pub fn encode_with(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Prompt, ChatError> {
        let extra: Vec<(&str, Value)> = kwargs
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from_serialize(v)))
            .collect();
        let text = self.render(messages, tools, true, &extra)?;
        let ids = encode_text(tokenizer, &text)?;
        Ok(Prompt { text, ids })
    }
}

/// Tokenizes text without adding special tokens (as `apply_chat_template` does).
pub fn encode_text(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, ChatError> {
    tokenizer
        .encode(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| ChatError::Tokenize(e.to_string()))
}

/// Parses JSON text into a template value, keeping object key order. `what` names the input in
/// errors.
pub fn parse_json_value(text: &str, what: &str) -> Result<Value, ChatError> {
    serde_json::from_str::<Value>(text).map_err(|e| ChatError::Input {
        what: what.to_string(),
        message: format!("invalid JSON: {e}"),
    })
}

/// Checks that `messages` is a non-empty list of objects with a string `role`.
pub fn validate_messages(messages: &Value, what: &str) -> Result<(), ChatError> {
    let bad = |m: String| ChatError::Input {
        what: what.to_string(),
        message: m,
    };
    if messages.kind() != ValueKind::Seq {
        return Err(bad("expected a JSON list of messages".into()));
    }
    let n = messages.len().unwrap_or(0);
    if n == 0 {
        return Err(bad("the message list is empty".into()));
    }
    for i in 0..n {
        let m = messages
            .get_item_by_index(i)
            .map_err(|e| bad(e.to_string()))?;
        if m.kind() != ValueKind::Map {
            return Err(bad(format!("message {i} is not an object")));
        }
        let role = m.get_attr("role").unwrap_or(Value::UNDEFINED);
        if role.as_str().is_none() {
            return Err(bad(format!("message {i} has no string \"role\"")));
        }
    }
    Ok(())
}

/// Checks that `tools` is a list of objects.
pub fn validate_tools(tools: &Value, what: &str) -> Result<(), ChatError> {
    let bad = |m: String| ChatError::Input {
        what: what.to_string(),
        message: m,
    };
    if tools.kind() != ValueKind::Seq {
        return Err(bad("expected a JSON list of tools".into()));
    }
    for i in 0..tools.len().unwrap_or(0) {
        let t = tools.get_item_by_index(i).map_err(|e| bad(e.to_string()))?;
        if t.kind() != ValueKind::Map {
            return Err(bad(format!("tool {i} is not an object")));
        }
    }
    Ok(())
}

fn error_chain(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        let _ = write!(s, ": {cause}");
        src = cause.source();
    }
    s
}

/// Jinja `raise_exception(msg)`: fails the render with `msg`.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `tojson` as Hugging Face defines it: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            if let Some(s) = v.as_str() {
                Some(s.to_string())
            } else {
                let n = usize::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int")
                })?;
                Some(" ".repeat(n))
            }
        }
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        // Python: (', ', ': ') without indent, (',', ': ') with it.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let fmt = JsonFmt {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    fmt.write(&mut out, value, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonFmt {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonFmt {
    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone())?;
                    out.push_str(&python_float_repr(f));
                }
            }
            ValueKind::String => write_json_string(out, v.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    self.write(out, item, depth + 1)?;
                }
                self.newline(out, depth);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|a| a.to_string());
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, depth + 1);
                    match k.as_str() {
                        Some(s) => write_json_string(out, s),
                        None => write_json_string(out, &k.to_string()),
                    }
                    out.push_str(&self.key_sep);
                    self.write(out, &v.get_item(k)?, depth + 1)?;
                }
                self.newline(out, depth);
                out.push('}');
            }
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialize a {other:?}"),
                ))
            }
        }
        Ok(())
    }
}

/// A JSON string literal as Python's `json.dumps(ensure_ascii=False)` writes it.
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, `1.0` for integral values, scientific
/// notation (`1e-05`, `1e+16`) outside `[1e-4, 1e16)`, `NaN`/`Infinity` as `json.dumps` writes.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust `{:e}` gives e.g. "1e-5" / "1.5e16"; Python writes "1e-05" / "1.5e+16".
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').expect("{:e} has an exponent");
        let exp: i32 = exp.parse().expect("integer exponent");
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpl(src: &str) -> ChatTemplate {
        ChatTemplate::new(src, "test", vec![]).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = tmpl("{{ x | tojson }}");
        let x = parse_json_value(
            r#"{"b": 1, "a": [1.5, 2.0, "é\"<>&'\n", null, true], "c": {}, "d": 1e-7}"#,
            "x",
        )
        .unwrap();
        let out = t
            .render(&Value::from(()), None, false, &[("x", x)])
            .unwrap();
        assert_eq!(
            out,
            r#"{"b": 1, "a": [1.5, 2.0, "é\"<>&'\n", null, true], "c": {}, "d": 1e-07}"#
        );
        let t = tmpl("{{ x | tojson(indent=2) }}");
        let x = parse_json_value(r#"{"a": [1, 2]}"#, "x").unwrap();
        let out = t
            .render(&Value::from(()), None, false, &[("x", x)])
            .unwrap();
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn raise_exception_and_loop_controls_and_namespace() {
        let t =
            tmpl("{% if messages|length == 0 %}{{ raise_exception('no messages!') }}{% endif %}ok");
        let e = t
            .render(&Value::from(Vec::<Value>::new()), None, false, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no messages!"), "{e}");
        let t = tmpl(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
             {% set ns.n = ns.n + 1 %}{{ m.content.strip() }}{% if loop.last %}{% break %}{% endif %}{% endfor %}{{ ns.n }}",
        );
        let msgs = parse_json_value(
            r#"[{"role":"system","content":"s"},{"role":"user","content":" hi "}]"#,
            "m",
        )
        .unwrap();
        assert_eq!(t.render(&msgs, None, false, &[]).unwrap(), "hi1");
    }

    #[test]
    fn python_float_repr_cases() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(-2.5e-5), "-2.5e-05");
        assert_eq!(python_float_repr(123456.75), "123456.75");
    }
}

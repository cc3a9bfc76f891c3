//! The tool-call policy's tokenizer ([`crate::experiments::word_tokenizer`]): a word-level
//! model whose pre-tokenizer isolates every letter run, every single digit, every whitespace character and
//! every punctuation character, with a `Fuse` decoder, so that decoding gives back the exact
//! text (Python code and JSON survive the round trip) and numbers are read and written digit by
//! digit. `<tool_call>` / `</tool_call>` are single (non-special) tokens; the Qwen chat markers
//! are special. Unknown words (e.g. in a Python traceback) become `[UNK]`.
//!
//! The chat template renders user, assistant (content, then each tool call in Qwen's
//! `<tool_call>` markup) and tool messages in the Qwen layout; it does **not** render system
//! messages or tool schemas (the environment's fixed system prompt and `code_interpreter` schema
//! would triple the prompt of this tiny policy; the warm start teaches it the tool's format).
//! [`continuation_ids`] appends tool results to a transcript by token concatenation, so that
//! every later prompt holds the exact ids sampled before (docs/design.md §1: never re-tokenised).

use serde_json::{json, Value};

pub use crate::experiments::word_tokenizer::TokenizerError;
use crate::experiments::word_tokenizer::WordTokenizer;
pub use crate::experiments::word_tokenizer::{IM_END, IM_START, PAD};
use clawrl::model::{ChatError, ChatTemplate, TokenizerFiles};

/// Opens a tool call (id 3).
pub const TOOL_OPEN: &str = "<tool_call>";
/// Closes a tool call (id 4).
pub const TOOL_CLOSE: &str = "</tool_call>";
/// Any piece outside the vocabulary (id 5).
pub const UNK: &str = "[UNK]";

/// The pieces the pre-tokenizer isolates.
pub const PIECES: &str = r"[A-Za-z_]+|[0-9]|\s|[^A-Za-z0-9_\s]";

/// Words of the vocabulary (questions, code, the tool call's JSON, the tool's output).
const WORDS: &[&str] = &[
    "what",
    "is",
    "plus",
    "minus",
    "times",
    "print",
    "name",
    "arguments",
    "code",
    "code_interpreter",
    "exit",
    "stdout",
    "stderr",
    "boxed",
    "none",
    "timed",
    "out",
    "after",
    "s",
    "killed",
    "by",
    "signal",
    "error",
    "not",
    "run",
    "the",
    "budget",
    "of",
    "tool",
    "calls",
    "used",
    "up",
    "give",
    "your",
    "final",
    "answer",
    "user",
    "assistant",
    "system",
];

/// The chat template (Qwen layout, no system messages or tool schemas; see the module doc).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{%- if message.role != 'system' %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}{%- if message.tool_calls %}{%- for tc in message.tool_calls %}{{- '<tool_call>\\n' + (tc.function | tojson) + '\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// The vocabulary: the special tokens (ids 0..=5), the words, the digits, ASCII punctuation,
/// space and newline.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = [PAD, IM_START, IM_END, TOOL_OPEN, TOOL_CLOSE, UNK]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend(WORDS.iter().map(|w| w.to_string()));
    v.extend(('0'..='9').map(String::from));
    v.extend(
        (0x21u8..0x7f)
            .map(char::from)
            .filter(|c| c.is_ascii_punctuation())
            .map(String::from),
    );
    v.push(" ".into());
    v.push("\n".into());
    v
}

/// The tokenizer's definition: the vocabulary, every piece of [`PIECES`] isolated, and a
/// `Fuse` decoder, so decoding gives back the exact text.
pub fn word_tokenizer() -> WordTokenizer {
    WordTokenizer {
        name: "tool-call",
        vocab: vocabulary(),
        added: vec![
            (PAD, true),
            (IM_START, true),
            (IM_END, true),
            (TOOL_OPEN, false),
            (TOOL_CLOSE, false),
        ],
        unk: UNK,
        normalizer: Value::Null,
        pre_tokenizer: json!({"type": "Split", "pattern": {"Regex": PIECES},
                              "behavior": "Isolated", "invert": false}),
        decoder: json!({"type": "Fuse"}),
        chat_template: CHAT_TEMPLATE,
        model_max_length: None,
    }
}

/// The tokenizer files of the checkpoint.
pub fn tokenizer_files() -> TokenizerFiles {
    word_tokenizer().files()
}

/// The tokenizer.
pub fn build_tokenizer() -> Result<tokenizers::Tokenizer, TokenizerError> {
    word_tokenizer().build()
}

/// The chat template.
pub fn chat_template() -> Result<ChatTemplate, ChatError> {
    ChatTemplate::new(
        CHAT_TEMPLATE,
        "tool-call chat template",
        vec![("eos_token".into(), IM_END.into())],
    )
}

/// The text of a `code_interpreter` call running `code`.
///
/// The JSON is written as the chat template writes a tool call back into the history (its
/// `tojson` is Python's `json.dumps`: keys in order, `", "` and `": "` between them), so that a
/// job's rollouts, which render each step's prompt from the messages, show the policy the very
/// text it learned to write.
pub fn call_text(code: &str) -> String {
    let code = serde_json::to_string(code).expect("a string serializes");
    let name = clawrl::env::tool_call::INTERPRETER_TOOL;
    format!(
        "{TOOL_OPEN}\n{{\"arguments\": {{\"code\": {code}}}, \"name\": \"{name}\"}}\n{TOOL_CLOSE}"
    )
}

/// What follows a response that ended with the stop token when the environment answered with
/// the tool messages `contents`: the newline closing the assistant message, each tool message,
/// and the next assistant header.
pub fn continuation_text(contents: &[String]) -> String {
    let mut s = String::from("\n");
    for c in contents {
        s.push_str(&format!("{IM_START}tool\n{c}{IM_END}\n"));
    }
    s.push_str(&format!("{IM_START}assistant\n"));
    s
}

/// [`continuation_text`] as token ids.
pub fn continuation_ids(
    tokenizer: &tokenizers::Tokenizer,
    contents: &[String],
) -> Result<Vec<u32>, ChatError> {
    clawrl::model::chat::encode_text(tokenizer, &continuation_text(contents))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_json_and_numbers_round_trip_digit_by_digit() {
        let tok = build_tokenizer().unwrap();
        let unk = tok.token_to_id(UNK).unwrap();
        assert_eq!(tok.token_to_id(IM_END), Some(2));
        let text = format!("{}\\boxed{{-1345}}", call_text("print(47*29-18)"));
        let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert!(!ids.contains(&unk), "{text}");
        assert_eq!(ids[0], tok.token_to_id(TOOL_OPEN).unwrap());
        assert_eq!(tok.decode(&ids, true).unwrap(), text);
        // Digits are separate tokens.
        let n = tok.encode("1345", false).unwrap();
        assert_eq!(n.get_ids().len(), 4);
        // Unknown words become [UNK]; known ones do not.
        let t = tok.encode("Traceback: print", false).unwrap();
        assert_eq!(t.get_ids()[0], unk);
        assert_ne!(*t.get_ids().last().unwrap(), unk);
    }

    #[test]
    fn the_template_renders_what_the_transcript_concatenates() {
        let tok = build_tokenizer().unwrap();
        let tpl = chat_template().unwrap();
        let msgs = json!([
            {"role": "system", "content": "a long system prompt"},
            {"role": "user", "content": "what is 2+3*4 ?"},
        ]);
        let p = tpl
            .encode(&tok, &minijinja::Value::from_serialize(&msgs), None)
            .unwrap();
        let want = format!("{IM_START}user\nwhat is 2+3*4 ?{IM_END}\n{IM_START}assistant\n");
        assert_eq!(
            p.ids,
            clawrl::model::chat::encode_text(&tok, &want).unwrap()
        );
        // A tool turn appended by ids equals the template's rendering of the same messages
        // (the assistant message given as its raw text).
        let call = call_text("print(2+3*4)");
        let out = "exit code: 0\nstdout:\n14\nstderr:\n".to_string();
        let msgs2 = json!([
            {"role": "user", "content": "what is 2+3*4 ?"},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": out},
        ]);
        let full = tpl
            .encode(&tok, &minijinja::Value::from_serialize(&msgs2), None)
            .unwrap();
        let mut by_ids = p.ids.clone();
        by_ids.extend(clawrl::model::chat::encode_text(&tok, &call).unwrap());
        by_ids.push(tok.token_to_id(IM_END).unwrap());
        by_ids.extend(continuation_ids(&tok, std::slice::from_ref(&out)).unwrap());
        assert_eq!(full.ids, by_ids);
        // A job's rollout holds the call as a parsed tool call (`exec::assistant_message`) and
        // renders it back with the template: the same ids as the text the policy wrote.
        let action = clawrl::pipeline::policy::action_of(&call, call.clone(), "call-0");
        assert_eq!(action.tool_calls.len(), 1, "{call}");
        let msgs3 = json!([
            {"role": "user", "content": "what is 2+3*4 ?"},
            clawrl::env::exec::assistant_message(&action),
            {"role": "tool", "content": out},
        ]);
        let rendered = tpl
            .encode(&tok, &minijinja::Value::from_serialize(&msgs3), None)
            .unwrap();
        assert_eq!(rendered.ids, full.ids);
    }
}

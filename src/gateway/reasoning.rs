//! Qwen3's reasoning, apart from its answer: the text between `<think>` and `</think>` is
//! returned as `reasoning_content` (streamed as `delta.reasoning_content`), the rest as
//! `content`, following the convention of vLLM's `qwen3` reasoning parser. Pure and
//! incremental; the streamed pieces always concatenate to what the whole text gives.
//!
//! The rules:
//! - **Where reasoning starts.** The answer opens in reasoning when the model's first
//!   non-whitespace text is `<think>`, or when the prompt itself ends inside an open `<think>`
//!   (the "prefix format" of Qwen3 thinking templates, whose output holds only `</think>`).
//!   Otherwise the whole answer is content, and tags in it are plain text.
//! - **Where it ends.** At the first `</think>`; everything after it is content. Reasoning never
//!   closed (the answer was cut off while thinking) is all reasoning, streamed or not.
//! - **Whitespace.** The tags are dropped, with the newlines the template puts around them
//!   (after `<think>`, before `</think>`, and before the content that follows), as the Qwen3
//!   template strips them when it renders the turn back into a prompt.

use super::text::longest_suffix_prefix;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// One output of the splitter: reasoning text, or answer text (`C`: the answer's text, or
/// what a later stage made of it, such as tool calls).
#[derive(Debug, Clone, PartialEq)]
pub enum Part<C = String> {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text (which may hold tool calls).
    Content(C),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but whitespace seen yet.
    Start,
    /// Inside the reasoning; `fresh` until its first text went out.
    Reasoning { fresh: bool },
    /// After the reasoning (or an answer without one); `fresh` until its first text went out.
    Content { fresh: bool },
}

/// Splits streamed answer text into reasoning and content.
#[derive(Debug)]
pub struct ReasoningSplitter {
    state: State,
    buf: String,
}

/// Whether `prompt` ends inside an open `<think>` (only whitespace after it).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match prompt.rfind(OPEN) {
        Some(i) => prompt[i + OPEN.len()..].trim().is_empty(),
        None => false,
    }
}

impl ReasoningSplitter {
    /// A splitter for the answer to `prompt` (the rendered prompt text).
    pub fn new(prompt: &str) -> Self {
        let state = if prompt_opens_reasoning(prompt) {
            State::Reasoning { fresh: true }
        } else {
            State::Start
        };
        ReasoningSplitter {
            state,
            buf: String::new(),
        }
    }

    /// Feeds a piece of text; returns what can be emitted now (a possible partial tag and
    /// newlines that may belong to one are held back).
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning { fresh: true };
                    } else if t.is_empty() || OPEN.starts_with(t) {
                        break;
                    } else {
                        self.state = State::Content { fresh: false };
                    }
                }
                State::Reasoning { fresh } => {
                    if fresh && !drop_leading_newlines(&mut self.buf) {
                        break;
                    }
                    if let Some(c) = self.buf.find(CLOSE) {
                        let reasoning = self.buf[..c].trim_end_matches('\n');
                        if !reasoning.is_empty() {
                            out.push(Part::Reasoning(reasoning.to_string()));
                        }
                        self.buf.drain(..c + CLOSE.len());
                        self.state = State::Content { fresh: true };
                        continue;
                    }
                    // Hold back what may be the start of `</think>`, and the newlines before it.
                    let hold = longest_suffix_prefix(&self.buf, CLOSE);
                    let n = self.buf[..self.buf.len() - hold]
                        .trim_end_matches('\n')
                        .len();
                    if n > 0 {
                        out.push(Part::Reasoning(self.buf[..n].to_string()));
                        self.buf.drain(..n);
                        self.state = State::Reasoning { fresh: false };
                    }
                    break;
                }
                State::Content { fresh } => {
                    if fresh {
                        if !drop_leading_newlines(&mut self.buf) {
                            break;
                        }
                        self.state = State::Content { fresh: false };
                    }
                    if !self.buf.is_empty() {
                        out.push(Part::Content(std::mem::take(&mut self.buf)));
                    }
                    break;
                }
            }
        }
        out
    }

    /// Ends the answer: what is held back goes out (trailing newlines of reasoning never
    /// closed are dropped, as before a `</think>`).
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Start => (!rest.is_empty())
                .then_some(Part::Content(rest))
                .into_iter()
                .collect(),
            State::Reasoning { fresh } => {
                let t = if fresh {
                    rest.trim_matches('\n')
                } else {
                    rest.trim_end_matches('\n')
                };
                (!t.is_empty())
                    .then(|| Part::Reasoning(t.to_string()))
                    .into_iter()
                    .collect()
            }
            // Content is never held back once it started; a fresh one held only newlines.
            State::Content { .. } => Vec::new(),
        }
    }
}

/// Drops the newlines `buf` starts with (the template's, after a tag); whether text is left.
fn drop_leading_newlines(buf: &mut String) -> bool {
    let n = buf.len() - buf.trim_start_matches('\n').len();
    buf.drain(..n);
    !buf.is_empty()
}

/// The whole answer split at once (what a non-streamed answer carries): `(reasoning, content)`
/// by the same rules as streaming it through [`ReasoningSplitter`]; `None` when there is no
/// reasoning.
pub fn split_reasoning(prompt: &str, text: &str) -> (Option<String>, String) {
    let mut s = ReasoningSplitter::new(prompt);
    let mut parts = s.push(text);
    parts.extend(s.finish());
    let mut reasoning = String::new();
    let mut content = String::new();
    for p in parts {
        match p {
            Part::Reasoning(r) => reasoning.push_str(&r),
            Part::Content(c) => content.push_str(&c),
        }
    }
    ((!reasoning.is_empty()).then_some(reasoning), content)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROMPT: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    const PREFIX_PROMPT: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n";

    fn cases() -> Vec<(
        &'static str,
        &'static str,
        Option<&'static str>,
        &'static str,
    )> {
        vec![
            // (prompt, answer, reasoning, content)
            (PROMPT, "This is the rest", None, "This is the rest"),
            (
                PROMPT,
                "<think>\nThis is a reasoning\nsection\n</think>\n\nThis is the rest\nThat",
                Some("This is a reasoning\nsection"),
                "This is the rest\nThat",
            ),
            (PROMPT, "<think>abc</think>", Some("abc"), ""),
            // Cut off while thinking: all reasoning.
            (PROMPT, "<think>\nstill thinking\n", Some("still thinking"), ""),
            // Leading whitespace before the tag.
            (PROMPT, "\n <think>r</think>c", Some("r"), "c"),
            // A tag later in an answer that did not open with one is plain text.
            (PROMPT, "ok <think>x</think> y", None, "ok <think>x</think> y"),
            // The prefix format: the prompt opened the reasoning.
            (PREFIX_PROMPT, "reasoning here</think>\n\nthe rest", Some("reasoning here"), "the rest"),
            (PREFIX_PROMPT, "no close yet", Some("no close yet"), ""),
            // Thinking switched off: the template closed an empty block in the prompt.
            (
                "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                "Just the answer",
                None,
                "Just the answer",
            ),
            // A tool call after the reasoning stays in the content.
            (
                PROMPT,
                "<think>call it</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
                Some("call it"),
                "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            ),
            // Only whitespace, or a partial tag, at the end of an answer.
            (PROMPT, "\n\n", None, "\n\n"),
            (PROMPT, "<thi", None, "<thi"),
            (PROMPT, "<think>a</thi", Some("a</thi"), ""),
        ]
    }

    #[test]
    fn whole_answers_split_into_reasoning_and_content() {
        for (prompt, text, reasoning, content) in cases() {
            assert_eq!(
                split_reasoning(prompt, text),
                (reasoning.map(str::to_string), content.to_string()),
                "{text:?}"
            );
        }
    }

    #[test]
    fn streaming_in_any_pieces_gives_what_the_whole_text_gives() {
        for (prompt, text, reasoning, content) in cases() {
            // Every split into pieces of n characters, n = 1..=4, and every two-piece split.
            let chars: Vec<char> = text.chars().collect();
            let mut splits: Vec<Vec<String>> = (1..=4)
                .map(|n| chars.chunks(n).map(|c| c.iter().collect()).collect())
                .collect();
            for i in 0..=chars.len() {
                splits.push(vec![
                    chars[..i].iter().collect(),
                    chars[i..].iter().collect(),
                ]);
            }
            for pieces in splits {
                let mut s = ReasoningSplitter::new(prompt);
                let mut got_r = String::new();
                let mut got_c = String::new();
                let mut parts = Vec::new();
                for p in &pieces {
                    parts.extend(s.push(p));
                }
                parts.extend(s.finish());
                for p in parts {
                    match p {
                        Part::Reasoning(r) => {
                            assert!(got_c.is_empty(), "reasoning after content: {pieces:?}");
                            got_r.push_str(&r)
                        }
                        Part::Content(c) => got_c.push_str(&c),
                    }
                }
                assert_eq!(got_r, reasoning.unwrap_or(""), "{pieces:?}");
                assert_eq!(got_c, content, "{pieces:?}");
            }
        }
    }

    #[test]
    fn reasoning_streams_before_it_is_closed() {
        let mut s = ReasoningSplitter::new(PROMPT);
        assert_eq!(s.push("<thi"), vec![]);
        assert_eq!(
            s.push("nk>\nStep one"),
            vec![Part::Reasoning("Step one".into())]
        );
        assert_eq!(s.push(".\n</"), vec![Part::Reasoning(".".into())]);
        assert_eq!(s.push("think>\n\nDone"), vec![Part::Content("Done".into())]);
        assert_eq!(s.finish(), vec![]);
    }

    #[test]
    fn the_prompt_opens_reasoning_only_when_it_ends_inside_think() {
        assert!(prompt_opens_reasoning(PREFIX_PROMPT));
        assert!(!prompt_opens_reasoning(PROMPT));
        assert!(!prompt_opens_reasoning("<think>\n\n</think>\n\n"));
        assert!(!prompt_opens_reasoning("<think>x"));
    }
}

//! From sampled ids to the text a client sees, incrementally and exactly: the served text is
//! always the decoding of the sampled ids (a final stop token excluded), cut at the first stop
//! string. [`TextStream`] yields that text piece by piece as tokens arrive, holding back bytes
//! that may still become a stop string or an incomplete UTF-8 character; [`ToolCallSplitter`]
//! turns the pieces into content deltas and whole `<tool_call>` blocks. Both are pure.

use crate::model::tool_call::{parse_tool_calls, ToolCall};

/// The visible text of a response: `decoded` cut before the first stop string, if any.
pub fn cut_at_stop<'a>(decoded: &'a str, stops: &[String]) -> &'a str {
    let cut = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| decoded.find(s.as_str()))
        .min();
    match cut {
        Some(i) => &decoded[..i],
        None => decoded,
    }
}

/// Incremental visible text: feed it the full decoding so far, it returns what is new and safe.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    emitted: usize,
}

impl TextStream {
    /// A stream cutting at `stops`.
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, emitted: 0 }
    }

    /// `decoded` is the decoding of every response id so far. Returns the new visible text that
    /// can no longer change (`final_` releases everything that is held back).
    pub fn push(&mut self, decoded: &str, final_: bool) -> String {
        let visible = cut_at_stop(decoded, &self.stops);
        let mut end = visible.len();
        if !final_ {
            // An incomplete UTF-8 sequence decodes to U+FFFD at the end; wait for its bytes.
            while visible[..end].ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            // Hold back a suffix that could still grow into a stop string.
            let hold = self
                .stops
                .iter()
                .map(|s| longest_suffix_prefix(&visible[..end], s))
                .max()
                .unwrap_or(0);
            end -= hold;
        }
        if end <= self.emitted || !visible.is_char_boundary(self.emitted) {
            return String::new();
        }
        let out = visible[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with.
pub(crate) fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .filter(|&n| stop.is_char_boundary(n))
        .find(|&n| text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

/// One output of the splitter.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Plain assistant text.
    Content(String),
    /// A complete, well-formed tool call.
    ToolCall(ToolCall),
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Splits streamed text into content and complete tool calls. A malformed or unterminated
/// block is passed through as content, so nothing the model wrote is lost.
#[derive(Debug, Default)]
pub struct ToolCallSplitter {
    buf: String,
    inside: bool,
}

impl ToolCallSplitter {
    /// Feeds a piece of text; returns what can be emitted now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.inside {
                let Some(c) = self.buf.find(CLOSE) else {
                    break;
                };
                let block: String = self.buf.drain(..c + CLOSE.len()).collect();
                self.inside = false;
                match parse_tool_calls(&block) {
                    Ok(p) if p.tool_calls.len() == 1 && p.content.is_empty() => {
                        out.push(Piece::ToolCall(p.tool_calls.into_iter().next().unwrap()))
                    }
                    _ => out.push(Piece::Content(block)),
                }
            } else if let Some(o) = self.buf.find(OPEN) {
                if o > 0 {
                    out.push(Piece::Content(self.buf[..o].to_string()));
                }
                self.buf.drain(..o);
                self.inside = true;
            } else {
                // Keep a tail that may be the start of `<tool_call>`.
                let hold = longest_suffix_prefix(&self.buf, OPEN);
                let n = self.buf.len() - hold;
                if n > 0 {
                    out.push(Piece::Content(self.buf[..n].to_string()));
                    self.buf.drain(..n);
                }
                break;
            }
        }
        out
    }

    /// Ends the stream: whatever is held back is content.
    pub fn finish(&mut self) -> Vec<Piece> {
        self.inside = false;
        if self.buf.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Content(std::mem::take(&mut self.buf))]
        }
    }
}

/// The whole visible text split at once (what the non-streaming answer carries): the same
/// rules as streaming it through [`ToolCallSplitter`], content pieces concatenated.
pub fn split_all(text: &str) -> (String, Vec<ToolCall>) {
    let mut s = ToolCallSplitter::default();
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Content(c) => content.push_str(&c),
            Piece::ToolCall(t) => calls.push(t),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_and_are_held_back() {
        let mut s = TextStream::new(vec!["END".into()]);
        assert_eq!(s.push("hello E", false), "hello ");
        assert_eq!(s.push("hello EN", false), "");
        assert_eq!(s.push("hello ENX", false), "ENX");
        assert_eq!(s.push("hello ENX fooEND bar", false), " foo");
        assert_eq!(s.push("hello ENX fooEND bar", true), "");
        assert_eq!(cut_at_stop("abEND", &["END".into()]), "ab");
    }

    #[test]
    fn incomplete_utf8_waits_and_final_releases() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push("a\u{FFFD}", false), "a");
        assert_eq!(s.push("aé", false), "é");
        let mut s = TextStream::new(vec!["xy".into()]);
        assert_eq!(s.push("abx", false), "ab");
        assert_eq!(s.push("abx", true), "x");
    }

    #[test]
    fn tool_calls_split_across_pieces() {
        let text =
            "Sure.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call> ok";
        // Any chunking gives the same pieces once concatenated.
        for chunk in 1..text.len() {
            let mut sp = ToolCallSplitter::default();
            let mut pieces = Vec::new();
            let mut rest = text;
            while !rest.is_empty() {
                let mut n = chunk.min(rest.len());
                while !rest.is_char_boundary(n) {
                    n += 1;
                }
                pieces.extend(sp.push(&rest[..n]));
                rest = &rest[n..];
            }
            pieces.extend(sp.finish());
            let content: String = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Content(c) => Some(c.as_str()),
                    _ => None,
                })
                .collect();
            let calls: Vec<_> = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::ToolCall(c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(content, "Sure. ok", "chunk {chunk}");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].name, "f");
            assert_eq!(calls[0].arguments["a"], 1);
        }
    }

    #[test]
    fn malformed_or_unterminated_blocks_stay_content() {
        let (c, t) = split_all("a<tool_call>{oops}</tool_call>b");
        assert_eq!(c, "a<tool_call>{oops}</tool_call>b");
        assert!(t.is_empty());
        let (c, t) = split_all("a<tool_call>{\"name\":\"x\"}");
        assert_eq!(c, "a<tool_call>{\"name\":\"x\"}");
        assert!(t.is_empty());
        let (c, t) = split_all("<tool_c");
        assert_eq!(c, "<tool_c");
        assert!(t.is_empty());
    }
}

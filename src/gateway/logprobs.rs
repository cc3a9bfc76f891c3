//! OpenAI's `logprobs` objects from the engine's raw log-probs: each sampled token as its text
//! and exact bytes, its log-prob under the model's own distribution, and its most likely
//! alternatives. Pure.
//!
//! A token's bytes are exact even when it holds part of a UTF-8 character: for a byte-level BPE
//! tokenizer (Qwen's), every character of the vocabulary entry stands for one byte; an added
//! token (`<|im_end|>`, `<tool_call>`) is its own text. The `token` string is those bytes read
//! as UTF-8, with U+FFFD for an incomplete character, as OpenAI shows it.

use std::collections::HashMap;

use serde_json::{json, Value as Json};
use tokenizers::{DecoderWrapper, Tokenizer};

use crate::model::RawLogprobs;

/// The bytes of every token id, precomputed from one tokenizer.
pub struct TokenBytes {
    bytes: Vec<Vec<u8>>,
}

impl TokenBytes {
    /// The bytes of each id of `tokenizer`'s vocabulary (added tokens included).
    pub fn new(tokenizer: &Tokenizer) -> Self {
        let byte_level = matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let added: HashMap<u32, String> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content))
            .collect();
        let size = tokenizer.get_vocab_size(true);
        let unicode_to_byte = unicode_to_byte();
        let bytes = (0..size as u32)
            .map(|id| {
                if let Some(text) = added.get(&id) {
                    return text.as_bytes().to_vec();
                }
                let Some(piece) = tokenizer.id_to_token(id) else {
                    return Vec::new();
                };
                if byte_level {
                    let mapped: Option<Vec<u8>> = piece
                        .chars()
                        .map(|c| unicode_to_byte.get(&c).copied())
                        .collect();
                    if let Some(b) = mapped {
                        return b;
                    }
                }
                tokenizer.decode(&[id], false).unwrap_or(piece).into_bytes()
            })
            .collect();
        Self { bytes }
    }

    /// The bytes of `id` (empty for an id outside the vocabulary).
    pub fn of(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// One OpenAI `{token, logprob, bytes}` object.
    fn entry(&self, id: u32, logprob: f32) -> Json {
        let b = self.of(id);
        json!({
            "token": String::from_utf8_lossy(b),
            "logprob": logprob,
            "bytes": b,
        })
    }

    /// The `logprobs.content` entries of sampled `ids` with their raw log-probs.
    pub fn content(&self, ids: &[u32], raw: &[RawLogprobs]) -> Vec<Json> {
        ids.iter()
            .zip(raw)
            .map(|(&id, r)| {
                let mut e = self.entry(id, r.logprob);
                e["top_logprobs"] = r.top.iter().map(|&(alt, lp)| self.entry(alt, lp)).collect();
                e
            })
            .collect()
    }
}

/// The inverse of GPT-2's byte-to-unicode table, which byte-level BPE vocabularies are written
/// in: printable Latin-1 bytes stand for themselves, and each other byte `b` (in increasing
/// order) for the character `256 + n`, `n` counting those bytes. (The `tokenizers` crate keeps
/// its copy private.)
fn unicode_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut n = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                n += 1;
                char::from_u32(255 + n).expect("a valid scalar")
            };
            (c, b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_a_bijection_with_gpt2s_known_points() {
        let t = unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' '); // U+0120
        assert_eq!(t[&'Ċ'], b'\n'); // U+010A
        assert_eq!(t[&'A'], b'A');
        assert_eq!(t[&'\u{100}'], 0);
        assert_eq!(t[&'\u{143}'], 0xAD);
    }
}

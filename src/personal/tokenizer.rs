//! The experiment's tokenizer, built in code: a word-level `tokenizers` model over the world's
//! vocabulary ([`super::corpus::vocabulary_texts`]), lower-casing, whitespace/punctuation
//! pre-tokenization and the three Qwen chat special tokens, plus a Qwen-style chat template.
//! Nothing is downloaded; the files are written into the SFT checkpoint as Hugging Face expects
//! them (`tokenizer.json`, `tokenizer_config.json` with `chat_template`).

use std::collections::BTreeSet;

use serde_json::{json, Value};
use thiserror::Error;

use super::corpus::vocabulary_texts;
use crate::model::TokenizerFiles;

/// The padding / end-of-text token (id 0).
pub const PAD: &str = "<|endoftext|>";
/// Starts a chat message (id 1).
pub const IM_START: &str = "<|im_start|>";
/// Ends a chat message and a response (id 2): the stop token.
pub const IM_END: &str = "<|im_end|>";
/// Stands for any word outside the vocabulary (id 3).
pub const UNK: &str = "[UNK]";

/// The chat template (the Qwen layout without tools or thinking).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Why the tokenizer could not be built.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// The `tokenizers` crate refused the generated `tokenizer.json`.
    #[error("building the word-level tokenizer: {0}")]
    Build(String),
}

/// Splits text the way the `Whitespace` pre-tokenizer does (`\w+|[^\w\s]+`), lower-cased.
pub fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut cur_word: Option<bool> = None;
    for ch in text.chars() {
        if ch.is_whitespace() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            cur_word = None;
            continue;
        }
        let is_word = ch.is_alphanumeric() || ch == '_';
        if cur_word.is_some_and(|w| w != is_word) && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur_word = Some(is_word);
        cur.extend(ch.to_lowercase());
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The vocabulary: the special tokens (ids 0..=3) then every word of the world, sorted.
pub fn vocabulary() -> Vec<String> {
    let mut set = BTreeSet::new();
    for t in vocabulary_texts() {
        set.extend(words(&t));
    }
    let mut vocab: Vec<String> = [PAD, IM_START, IM_END, UNK]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let specials = vocab.clone();
    vocab.extend(set.into_iter().filter(|w| !specials.contains(w)));
    vocab
}

/// The `tokenizer.json` text.
pub fn tokenizer_json() -> String {
    let vocab = vocabulary();
    let map: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = [PAD, IM_START, IM_END]
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": map, "unk_token": UNK},
    });
    serde_json::to_string_pretty(&doc).expect("json serializes")
}

/// The `tokenizer_config.json` text (special tokens and the chat template).
pub fn tokenizer_config_json() -> String {
    serde_json::to_string_pretty(&json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 128,
        "chat_template": CHAT_TEMPLATE,
    }))
    .expect("json serializes")
}

/// The tokenizer files of the checkpoint.
pub fn tokenizer_files() -> TokenizerFiles {
    TokenizerFiles {
        tokenizer_json: tokenizer_json(),
        tokenizer_config_json: Some(tokenizer_config_json()),
        chat_template_jinja: None,
        generation_config_json: None,
    }
}

/// The tokenizer itself.
pub fn build_tokenizer() -> Result<tokenizers::Tokenizer, TokenizerError> {
    tokenizers::Tokenizer::from_bytes(tokenizer_json().as_bytes())
        .map_err(|e| TokenizerError::Build(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::personal::corpus::sft_example;
    use rand::SeedableRng;

    #[test]
    fn fresh_corpus_text_round_trips_without_unknown_words() {
        let tok = build_tokenizer().unwrap();
        let unk = tok.token_to_id(UNK).unwrap();
        assert_eq!(tok.token_to_id(IM_END), Some(2));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(991);
        for _ in 0..300 {
            let ex = sft_example(0.5, &mut rng);
            let text = format!(
                "{} {}",
                ex.messages[1]["content"].as_str().unwrap(),
                ex.response
            );
            let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
            assert!(!ids.contains(&unk), "unknown word in {text}");
            let resp = tok.encode(ex.response.as_str(), false).unwrap();
            assert_eq!(tok.decode(resp.get_ids(), true).unwrap(), ex.response);
        }
        assert_eq!(
            words("a[b's]  c!?"),
            vec!["a", "[", "b", "'", "s", "]", "c", "!?"]
        );
    }
}

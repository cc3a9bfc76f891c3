//! The experiment's tokenizer ([`crate::experiments::word_tokenizer`]): words of the world's
//! vocabulary ([`super::corpus::vocabulary_texts`]), lower-cased, split at whitespace and
//! punctuation, the three Qwen chat special tokens, and a Qwen-style chat template.

use std::collections::BTreeSet;

use serde_json::json;

use super::corpus::vocabulary_texts;
pub use crate::experiments::word_tokenizer::TokenizerError;
use crate::experiments::word_tokenizer::WordTokenizer;
pub use crate::experiments::word_tokenizer::{IM_END, IM_START, PAD};
use clawrl::model::TokenizerFiles;

/// Stands for any word outside the vocabulary (id 3).
pub const UNK: &str = "[UNK]";

/// The chat template (the Qwen layout without tools or thinking).
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

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

/// The tokenizer's definition: the vocabulary, lower-casing, `Whitespace` pre-tokenization
/// (what [`words`] does) and the chat template.
pub fn word_tokenizer() -> WordTokenizer {
    WordTokenizer {
        name: "personal-experiment",
        vocab: vocabulary(),
        added: vec![(PAD, true), (IM_START, true), (IM_END, true)],
        unk: UNK,
        normalizer: json!({"type": "Lowercase"}),
        pre_tokenizer: json!({"type": "Whitespace"}),
        decoder: serde_json::Value::Null,
        chat_template: CHAT_TEMPLATE,
        model_max_length: Some(128),
    }
}

/// The tokenizer files of the checkpoint.
pub fn tokenizer_files() -> TokenizerFiles {
    word_tokenizer().files()
}

/// The tokenizer itself.
pub fn build_tokenizer() -> Result<tokenizers::Tokenizer, TokenizerError> {
    word_tokenizer().build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::personal::corpus::sft_example;
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

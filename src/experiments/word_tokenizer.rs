//! The experiments' tokenizers, built in code: a word-level `tokenizers` model over a fixed
//! vocabulary, with the Qwen chat markers as added tokens and a chat template, written as the
//! Hugging Face files a checkpoint carries (`tokenizer.json`, `tokenizer_config.json`). Nothing
//! is downloaded. Each experiment supplies its vocabulary, how text is split into words, and its
//! template; the rest is here once.

use serde_json::{json, Value};
use thiserror::Error;

use clawrl::model::TokenizerFiles;

/// The padding / end-of-text token (id 0 in both experiments).
pub const PAD: &str = "<|endoftext|>";
/// Starts a chat message (id 1).
pub const IM_START: &str = "<|im_start|>";
/// Ends a chat message and a response (id 2): the stop token.
pub const IM_END: &str = "<|im_end|>";

/// Why a tokenizer could not be built.
#[derive(Debug, Error)]
#[error("building the {name} tokenizer: {message}")]
pub struct TokenizerError {
    /// Which tokenizer.
    pub name: &'static str,
    /// What the `tokenizers` crate said about the generated `tokenizer.json`.
    pub message: String,
}

/// A word-level tokenizer's definition.
#[derive(Debug, Clone)]
pub struct WordTokenizer {
    /// Its name in errors.
    pub name: &'static str,
    /// Every token in id order. The first `added.len()` entries are the added tokens, in the
    /// same order.
    pub vocab: Vec<String>,
    /// Tokens matched in the raw text before it is split, each with whether it is special
    /// (skipped when decoding with `skip_special_tokens`).
    pub added: Vec<(&'static str, bool)>,
    /// The token any word outside the vocabulary becomes.
    pub unk: &'static str,
    /// The `normalizer` entry of `tokenizer.json` (`null` for none).
    pub normalizer: Value,
    /// The `pre_tokenizer` entry: how text is split into words.
    pub pre_tokenizer: Value,
    /// The `decoder` entry: how decoded words are joined (`null`: with spaces).
    pub decoder: Value,
    /// The Jinja chat template.
    pub chat_template: &'static str,
    /// `model_max_length` of `tokenizer_config.json`, when the policy has a fixed context.
    pub model_max_length: Option<usize>,
}

impl WordTokenizer {
    /// The `tokenizer.json` text.
    pub fn tokenizer_json(&self) -> String {
        let map: serde_json::Map<String, Value> = self
            .vocab
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), json!(i)))
            .collect();
        let added: Vec<Value> = self
            .added
            .iter()
            .enumerate()
            .map(|(id, (content, special))| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": special})
            })
            .collect();
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": self.normalizer,
            "pre_tokenizer": self.pre_tokenizer,
            "post_processor": null,
            "decoder": self.decoder,
            "model": {"type": "WordLevel", "vocab": map, "unk_token": self.unk},
        });
        serde_json::to_string_pretty(&doc).expect("json serializes")
    }

    /// The `tokenizer_config.json` text: the special tokens and the chat template.
    pub fn tokenizer_config_json(&self) -> String {
        let mut cfg = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": IM_END,
            "pad_token": PAD,
            "unk_token": self.unk,
            "chat_template": self.chat_template,
        });
        if let Some(n) = self.model_max_length {
            cfg["model_max_length"] = json!(n);
        }
        serde_json::to_string_pretty(&cfg).expect("json serializes")
    }

    /// The tokenizer files of a checkpoint.
    pub fn files(&self) -> TokenizerFiles {
        TokenizerFiles {
            tokenizer_json: self.tokenizer_json(),
            tokenizer_config_json: Some(self.tokenizer_config_json()),
            chat_template_jinja: None,
            generation_config_json: None,
        }
    }

    /// The tokenizer itself.
    pub fn build(&self) -> Result<tokenizers::Tokenizer, TokenizerError> {
        tokenizers::Tokenizer::from_bytes(self.tokenizer_json().as_bytes()).map_err(|e| {
            TokenizerError {
                name: self.name,
                message: e.to_string(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> WordTokenizer {
        WordTokenizer {
            name: "tiny",
            vocab: [PAD, IM_START, IM_END, "[UNK]", "hello", "world", "!"]
                .map(String::from)
                .to_vec(),
            added: vec![(PAD, true), (IM_START, true), (IM_END, true)],
            unk: "[UNK]",
            normalizer: json!({"type": "Lowercase"}),
            pre_tokenizer: json!({"type": "Whitespace"}),
            decoder: Value::Null,
            chat_template: "{{ messages }}",
            model_max_length: Some(64),
        }
    }

    #[test]
    fn ids_follow_the_vocabulary_and_markers_are_matched_whole() {
        let t = tiny().build().unwrap();
        let ids = t
            .encode("<|im_start|>Hello world !<|im_end|> nope", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, vec![1, 4, 5, 6, 2, 3]);
        assert_eq!(t.decode(&ids, true).unwrap(), "hello world ! [UNK]");
        let cfg: Value = serde_json::from_str(&tiny().tokenizer_config_json()).unwrap();
        assert_eq!(cfg["eos_token"], IM_END);
        assert_eq!(cfg["model_max_length"], 64);
    }

    #[test]
    fn a_refused_definition_names_the_tokenizer() {
        let mut bad = tiny();
        bad.pre_tokenizer = json!({"type": "NoSuchSplitter"});
        let e = bad.build().unwrap_err();
        assert_eq!(e.name, "tiny");
        assert!(
            e.to_string().starts_with("building the tiny tokenizer: "),
            "{e}"
        );
    }
}

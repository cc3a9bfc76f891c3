//! Reading recorded training samples from JSONL, one sample per line:
//! `{"prompt_ids":[..],"response_ids":[..],"advantages":[..],"old_logprobs":[..]?,
//! "ref_logprobs":[..]?,"rollout_logprobs":[..]?}`. Every line is validated (lengths agree, values
//! finite, response non-empty, ids inside the vocabulary); errors name the file, the line and
//! the field.

use std::path::Path;

use serde::Deserialize;

use super::batch::{Sample, SampleError};

/// Why a samples file was refused.
#[derive(Debug, thiserror::Error)]
pub enum SamplesError {
    /// The file could not be read.
    #[error("cannot read samples {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// A line is invalid.
    #[error("{path}:{line}: {reason}")]
    Line {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong, naming the field.
        reason: String,
    },
    /// The file has no sample.
    #[error("{path}: no samples")]
    Empty {
        /// The file.
        path: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSample {
    prompt_ids: Vec<u32>,
    response_ids: Vec<u32>,
    advantages: Vec<f64>,
    #[serde(default)]
    old_logprobs: Option<Vec<f64>>,
    #[serde(default)]
    ref_logprobs: Option<Vec<f64>>,
    #[serde(default)]
    rollout_logprobs: Option<Vec<f64>>,
}

fn to_f32(field: &'static str, v: Vec<f64>) -> Result<Vec<f32>, SampleError> {
    v.into_iter()
        .enumerate()
        .map(|(index, x)| {
            let y = x as f32;
            if y.is_finite() {
                Ok(y)
            } else {
                Err(SampleError::NonFinite {
                    field,
                    index,
                    value: y,
                })
            }
        })
        .collect()
}

/// The top-level key whose value contains byte `col` (1-based) of `line`, if any.
fn key_at(line: &str, col: usize) -> Option<String> {
    let bytes = line.as_bytes();
    let (mut i, mut depth, mut key) = (0usize, 0i32, None);
    while i < bytes.len() && i < col {
        match bytes[i] {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                let end = i.min(bytes.len());
                let mut j = i + 1;
                while j < bytes.len() && bytes[j].is_ascii_whitespace() {
                    j += 1;
                }
                if depth == 1 && j < bytes.len() && bytes[j] == b':' {
                    key = Some(String::from_utf8_lossy(&bytes[start..end]).into_owned());
                }
            }
            _ => {}
        }
        i += 1;
    }
    key
}

/// Parses and validates one JSONL line. `vocab`, when given, bounds the token ids.
pub fn parse_sample_line(text: &str, vocab: Option<usize>) -> Result<Sample, String> {
    let de = &mut serde_json::Deserializer::from_str(text);
    let raw: RawSample = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let field = if path != "." && !path.is_empty() {
            Some(path)
        } else if inner.is_syntax() || inner.is_data() {
            key_at(text, inner.column())
        } else {
            None
        };
        let at = text.get(inner.column().saturating_sub(1)..).unwrap_or("");
        let inner = if inner.is_syntax()
            && ["NaN", "Infinity", "-Infinity", "inf", "-inf"]
                .iter()
                .any(|t| at.starts_with(t))
        {
            format!("non-finite value (NaN or infinity) is not allowed ({inner})")
        } else {
            inner.to_string()
        };
        match field {
            Some(f) => format!("field `{f}`: {inner}"),
            None => format!("invalid sample: {inner}"),
        }
    })?;
    let sample = (|| -> Result<Sample, SampleError> {
        Ok(Sample {
            prompt_ids: raw.prompt_ids,
            response_ids: raw.response_ids,
            advantages: to_f32("advantages", raw.advantages)?,
            old_logprobs: raw
                .old_logprobs
                .map(|v| to_f32("old_logprobs", v))
                .transpose()?,
            ref_logprobs: raw
                .ref_logprobs
                .map(|v| to_f32("ref_logprobs", v))
                .transpose()?,
            rollout_logprobs: raw
                .rollout_logprobs
                .map(|v| to_f32("rollout_logprobs", v))
                .transpose()?,
            opd: None,
            importance: None,
        })
    })()
    .map_err(|e| e.to_string())?;
    sample.validate(vocab).map_err(|e| e.to_string())?;
    Ok(sample)
}

/// Reads every sample of a JSONL file (blank lines are skipped).
pub fn read_samples(path: &Path, vocab: Option<usize>) -> Result<Vec<Sample>, SamplesError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SamplesError::Read {
        path: name.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let sample = parse_sample_line(line, vocab).map_err(|reason| SamplesError::Line {
            path: name.clone(),
            line: i + 1,
            reason,
        })?;
        out.push(sample);
    }
    if out.is_empty() {
        return Err(SamplesError::Empty { path: name });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_line() {
        let s = parse_sample_line(
            r#"{"prompt_ids":[1,2],"response_ids":[3],"advantages":[0.5],"old_logprobs":[-1.0]}"#,
            Some(10),
        )
        .unwrap();
        assert_eq!(s.response_ids, vec![3]);
        assert_eq!(s.old_logprobs, Some(vec![-1.0]));
        assert_eq!(s.ref_logprobs, None);
    }

    #[test]
    fn errors_name_the_field() {
        for (line, needle) in [
            (
                r#"{"prompt_ids":[1],"response_ids":[3,4],"advantages":[0.5]}"#,
                "`advantages` has 1",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[],"advantages":[]}"#,
                "`response_ids` is empty",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[NaN]}"#,
                "field `advantages[0]`: non-finite",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[1],"old_logprobs":[-Infinity]}"#,
                "field `old_logprobs[0]`: non-finite",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[3],"advantages":[1e300]}"#,
                "`advantages` holds a non-finite",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[3.5],"advantages":[1]}"#,
                "response_ids",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[3],"advantage":[1]}"#,
                "advantage",
            ),
            (
                r#"{"prompt_ids":[1],"response_ids":[30],"advantages":[1]}"#,
                "outside the vocabulary",
            ),
        ] {
            let err = parse_sample_line(line, Some(10)).unwrap_err();
            assert!(err.contains(needle), "{line}: {err}");
        }
    }

    #[test]
    fn file_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.jsonl");
        std::fs::write(
            &p,
            "{\"prompt_ids\":[1],\"response_ids\":[3],\"advantages\":[1]}\n\n{\"prompt_ids\":[1],\"response_ids\":[3],\"advantages\":[1,2]}\n",
        )
        .unwrap();
        let err = read_samples(&p, None).unwrap_err().to_string();
        assert!(
            err.contains("s.jsonl:3:") && err.contains("advantages"),
            "{err}"
        );
    }
}

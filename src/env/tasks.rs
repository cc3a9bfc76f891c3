//! Reading task files strictly: JSONL (one JSON object a line, blank lines skipped) and single
//! JSON files, deserialised with unknown keys refused, every error naming the file, the line and
//! the key; plus the check that a path from a task stays inside the work dir.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use serde::de::DeserializeOwned;

/// Why a task set could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The file or directory could not be read.
    #[error("reading tasks {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// A task is malformed.
    #[error("{path}:{line}: `{key}`: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The 1-based line (1 for a whole-file JSON).
        line: usize,
        /// The key at fault (`.` for the whole object).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// The set holds no task.
    #[error("{path}: no tasks")]
    Empty {
        /// The file or directory.
        path: PathBuf,
    },
}

impl TaskError {
    /// A malformed task at `path:line`, key `key`.
    pub fn invalid(path: &Path, line: usize, key: &str, reason: impl Into<String>) -> Self {
        TaskError::Invalid {
            path: path.to_path_buf(),
            line,
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

/// Parses one JSON text into `T`, naming the key of the first error.
pub fn parse_json<T: DeserializeOwned>(
    path: &Path,
    line: usize,
    text: &str,
) -> Result<T, TaskError> {
    let de = &mut serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let reason = e.inner().to_string();
        let mut key = e.path().to_string();
        // serde reports missing and unknown fields at the enclosing object; name the field.
        for marker in ["missing field `", "unknown field `"] {
            if let Some(rest) = reason.strip_prefix(marker) {
                if let Some(field) = rest.split('`').next() {
                    let named = key.rsplit('.').next() == Some(field);
                    key = if key == "." {
                        field.to_string()
                    } else if named {
                        key
                    } else {
                        format!("{key}.{field}")
                    };
                }
            }
        }
        TaskError::invalid(path, line, &key, reason)
    })
}

/// Reads a JSONL file into `(line, T)` pairs; blank lines are skipped; an empty file is an
/// error.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>, TaskError> {
    let text = std::fs::read_to_string(path).map_err(|source| TaskError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        out.push((i + 1, parse_json(path, i + 1, l)?));
    }
    if out.is_empty() {
        return Err(TaskError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// The tasks of the JSONL task file at `path`: each line's object (`R`) has its id (`id`)
/// checked ([`check_id`], unique in the file), then becomes a task by `task` (given its line),
/// line by line, so the first line at fault is the one named.
pub fn read_tasks<R: DeserializeOwned, T>(
    path: &Path,
    id: impl Fn(&R) -> &str,
    mut task: impl FnMut(usize, R) -> Result<T, TaskError>,
) -> Result<Vec<T>, TaskError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (line, raw) in read_jsonl::<R>(path)? {
        check_id(path, line, id(&raw), &mut seen)?;
        out.push(task(line, raw)?);
    }
    Ok(out)
}

/// Test helper: what `load` reads from a task file holding `text`, written to a fresh
/// directory of this process (named by `kind` and the text's length) that is removed after.
#[cfg(test)]
pub(crate) fn load_text<T>(
    kind: &str,
    text: &str,
    load: impl Fn(&Path) -> Result<T, TaskError>,
) -> Result<T, TaskError> {
    let dir = std::env::temp_dir().join(format!(
        "clawrl-{kind}-tasks-{}-{}",
        std::process::id(),
        text.len()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("t.jsonl");
    std::fs::write(&f, text).unwrap();
    let r = load(&f);
    std::fs::remove_dir_all(&dir).unwrap();
    r
}

/// Checks an id: non-empty, at most 128 bytes of `[A-Za-z0-9._-]`, and not seen before.
pub fn check_id(
    path: &Path,
    line: usize,
    id: &str,
    seen: &mut HashSet<String>,
) -> Result<(), TaskError> {
    if id.is_empty()
        || id.len() > 128
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(TaskError::invalid(
            path,
            line,
            "id",
            format!("{id:?} must be 1 to 128 characters of A-Z a-z 0-9 . _ -"),
        ));
    }
    if !seen.insert(id.to_string()) {
        return Err(TaskError::invalid(
            path,
            line,
            "id",
            format!("{id:?} is used by an earlier task"),
        ));
    }
    Ok(())
}

/// Checks that a text field is not blank.
pub fn check_nonblank(path: &Path, line: usize, key: &str, value: &str) -> Result<(), TaskError> {
    if value.trim().is_empty() {
        return Err(TaskError::invalid(path, line, key, "must not be empty"));
    }
    Ok(())
}

/// Checks that `rel` is a relative path that stays inside the work dir: only normal
/// components (no `..`, no `.`, not absolute, not empty, no NUL), at most 4096 bytes.
pub fn check_relative_path(rel: &str) -> Result<PathBuf, String> {
    if rel.is_empty() {
        return Err("the path is empty".into());
    }
    if rel.len() > 4096 || rel.contains('\0') {
        return Err(format!("{rel:?} is too long or holds a NUL byte"));
    }
    let p = Path::new(rel);
    for c in p.components() {
        match c {
            Component::Normal(_) => {}
            Component::ParentDir => return Err(format!("{rel:?} leaves the work dir (`..`)")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!("{rel:?} is absolute; paths are relative to /work"))
            }
            Component::CurDir => return Err(format!("{rel:?} has a `.` component")),
        }
    }
    if rel.ends_with('/') {
        return Err(format!("{rel:?} names a directory, not a file"));
    }
    Ok(p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct T {
        id: String,
        inner: Inner,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        n: u32,
    }

    fn err(text: &str) -> (String, String) {
        match parse_json::<T>(Path::new("t.jsonl"), 7, text).unwrap_err() {
            TaskError::Invalid {
                key, reason, line, ..
            } => {
                assert_eq!(line, 7);
                (key, reason)
            }
            e => panic!("{e}"),
        }
    }

    #[test]
    fn errors_name_the_key() {
        assert_eq!(err(r#"{"inner":{"n":1}}"#).0, "id");
        assert_eq!(err(r#"{"id":"a","inner":{"n":1},"extra":1}"#).0, "extra");
        assert_eq!(err(r#"{"id":"a","inner":{"n":1,"m":2}}"#).0, "inner.m");
        assert_eq!(err(r#"{"id":"a","inner":{"n":"x"}}"#).0, "inner.n");
        assert_eq!(err(r#"{"id":"a","inner":{}}"#).0, "inner.n");
        let (_, reason) = err("{not json");
        assert!(!reason.is_empty());
    }

    #[test]
    fn relative_paths_are_checked() {
        assert!(check_relative_path("a/b.txt").is_ok());
        assert!(check_relative_path("../x").unwrap_err().contains(".."));
        assert!(check_relative_path("a/../../x").is_err());
        assert!(check_relative_path("/etc/passwd")
            .unwrap_err()
            .contains("absolute"));
        assert!(check_relative_path("./a").is_err());
        assert!(check_relative_path("").is_err());
        assert!(check_relative_path("a/").is_err());
        assert!(check_relative_path("a\0b").is_err());
    }

    #[test]
    fn ids_are_checked() {
        let mut seen = HashSet::new();
        let p = Path::new("t");
        assert!(check_id(p, 1, "ok-1.a_b", &mut seen).is_ok());
        assert!(check_id(p, 2, "ok-1.a_b", &mut seen).is_err());
        assert!(check_id(p, 3, "", &mut seen).is_err());
        assert!(check_id(p, 4, "a b", &mut seen).is_err());
    }

    #[test]
    fn jsonl_skips_blank_lines_and_refuses_empty_files() {
        let dir = std::env::temp_dir().join(format!("clawrl-tasks-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jsonl");
        std::fs::write(
            &f,
            "\n{\"id\":\"a\",\"inner\":{\"n\":1}}\n\n{\"id\":\"b\"}\n",
        )
        .unwrap();
        match read_jsonl::<T>(&f).unwrap_err() {
            TaskError::Invalid { line, key, .. } => {
                assert_eq!((line, key.as_str()), (4, "inner"));
            }
            e => panic!("{e}"),
        }
        std::fs::write(&f, "\n  \n").unwrap();
        assert!(matches!(read_jsonl::<T>(&f), Err(TaskError::Empty { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

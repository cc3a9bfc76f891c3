//! The dashboard: one self-contained page (`GET /dashboard`, no outside resources) and the JSON
//! it refreshes from (`GET /dashboard/data`, behind the API keys), served by a `personal`
//! job's gateway, by `clawrl serve`, and by `clawrl dashboard --out RUN_DIR` for any run.
//!
//! The data is a pure function of the run's records ([`build`]) plus, when a gateway serves it,
//! what the gateway knows now ([`Live`]). Per step: loss, policy-gradient loss and KL from the
//! `trainer_step` records. Per weight version: the mean reward, hint-accepted and failed-vote
//! rates, sessions and turns of the turns it served, from the `judge` records (a record file
//! holds one version's records). The serving version over time comes from the steps' wall
//! times. A missing, empty or half-written run gives empty series and a message saying so; a
//! torn last line is skipped and counted; a file that cannot be read is named, not fatal.
//!
//! Record files are re-read only when their size or modification time changed
//! ([`DashboardSource`]), so a long job's old versions are parsed once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use clawrl_actors::loops::recorder::ReadRecordsError;
use clawrl_actors::loops::{read_records, RecordFile, StepEvent};
use serde::Serialize;

use crate::gateway::auth::ApiKeys;
use crate::judge::votes::JudgedTurnRecord;

/// The page (HTML, CSS and script in one file).
pub const PAGE: &str = include_str!("dashboard.html");

/// Judged turns shown in the page's table.
pub const RECENT_TURNS: usize = 8;

/// What a serving gateway knows now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Live {
    /// The model id the page is about (a gateway serving several shows one at a time).
    pub model: String,
    /// The weight version new requests for it get.
    pub version: u64,
    /// Sessions open now.
    pub sessions_open: u64,
    /// Sessions opened since the start.
    pub sessions_started: u64,
    /// Main turns served since the start.
    pub main_turns: u64,
}

/// One trainer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRow {
    /// Optimizer steps after it.
    pub step: u64,
    /// The version it made.
    pub version: u64,
    /// Total loss.
    pub loss: f64,
    /// Policy-gradient term.
    pub pg_loss: f64,
    /// KL estimate.
    pub kl: f64,
    /// When it ended (seconds since the Unix epoch; 0 when the record predates the field).
    pub wall_time: f64,
}

/// The judged turns one version served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VersionRow {
    /// The version.
    pub version: u64,
    /// Turns with a judge record (judged or not).
    pub turns: u64,
    /// Distinct sessions among them.
    pub sessions: u64,
    /// Turns judged (they had a next state).
    pub judged: u64,
    /// Mean reward of the judged turns (`None` when none was).
    pub reward_mean: Option<f64>,
    /// Fraction of judged turns whose hint was accepted.
    pub hint_rate: Option<f64>,
    /// Fraction of votes that failed (`None` without votes).
    pub failed_vote_rate: Option<f64>,
}

/// One vote as the table shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VoteCell {
    /// `eval` or `hint`.
    pub kind: String,
    /// The score; `None` for a failed vote.
    pub score: Option<i8>,
}

/// A judged turn as the table shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecentTurn {
    /// The version that served it.
    pub version: u64,
    /// Its session.
    pub session_id: String,
    /// Its index in the session.
    pub turn: u64,
    /// Its reward.
    pub reward: i8,
    /// Its votes.
    pub votes: Vec<VoteCell>,
    /// The accepted hint.
    pub hint: Option<String>,
    /// Why it was not judged, when it was not.
    pub unjudged: Option<String>,
}

/// Everything the page shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DashboardData {
    /// Said above the plots when there is nothing (or something wrong) to show.
    pub message: Option<String>,
    /// Trainer steps, by step.
    pub steps: Vec<StepRow>,
    /// Judged turns per version, by version.
    pub versions: Vec<VersionRow>,
    /// The last judged turns, newest last.
    pub recent: Vec<RecentTurn>,
    /// The version served now (live), else the newest version a step made.
    pub serving_version: Option<u64>,
    /// The gateway's counters, when a gateway serves the page.
    pub live: Option<Live>,
    /// Torn last lines skipped.
    pub torn_lines: u64,
    /// Records that did not parse as their kind, skipped.
    pub skipped_records: u64,
    /// Files that could not be read, with why.
    pub problems: Vec<String>,
}

#[derive(Default)]
struct VersionAcc {
    turns: u64,
    sessions: BTreeSet<String>,
    judged: u64,
    reward_sum: i64,
    hints: u64,
    votes: u64,
    failed: u64,
}

/// The dashboard of a run whose record files are `files` (in version order, each read or not),
/// with `live` from a serving gateway; `records_dir` is named in messages.
pub fn build(
    records_dir: &Path,
    files: &[(PathBuf, Result<Arc<RecordFile>, String>)],
    live: Option<Live>,
) -> DashboardData {
    let mut steps = BTreeMap::new();
    let mut versions: BTreeMap<u64, VersionAcc> = BTreeMap::new();
    let mut recent = Vec::new();
    let (mut torn_lines, mut skipped_records) = (0, 0);
    let mut problems = Vec::new();
    for (path, file) in files {
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                problems.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        torn_lines += u64::from(file.torn_tail);
        for line in &file.lines {
            match line.kind.as_str() {
                "trainer_step" => match serde_json::from_value::<StepEvent>(line.record.clone()) {
                    Ok(e) => {
                        steps.insert(
                            e.step,
                            StepRow {
                                step: e.step,
                                version: e.version,
                                loss: e.loss,
                                pg_loss: e.pg_loss,
                                kl: e.kl,
                                wall_time: e.wall_time,
                            },
                        );
                    }
                    Err(_) => skipped_records += 1,
                },
                "judge" => {
                    let Ok(r) = serde_json::from_value::<JudgedTurnRecord>(line.record.clone())
                    else {
                        skipped_records += 1;
                        continue;
                    };
                    let acc = versions.entry(line.version).or_default();
                    acc.turns += 1;
                    acc.sessions.insert(r.session_id.clone());
                    if r.unjudged.is_none() {
                        acc.judged += 1;
                        acc.reward_sum += i64::from(r.reward);
                        acc.hints += u64::from(r.hint_accepted);
                    }
                    acc.votes += r.votes.len() as u64;
                    acc.failed += r.votes.iter().filter(|v| v.score.is_none()).count() as u64;
                    recent.push((line.version, r));
                }
                _ => {}
            }
        }
    }
    let recent: Vec<RecentTurn> = recent
        .split_off(recent.len().saturating_sub(RECENT_TURNS))
        .into_iter()
        .map(|(version, r)| RecentTurn {
            version,
            votes: r
                .votes
                .iter()
                .map(|v| VoteCell {
                    kind: serde_json::to_value(v.kind)
                        .ok()
                        .and_then(|k| k.as_str().map(str::to_string))
                        .unwrap_or_default(),
                    score: v.score,
                })
                .collect(),
            session_id: r.session_id,
            turn: r.turn,
            reward: r.reward,
            hint: r.hint,
            unjudged: r.unjudged,
        })
        .collect();
    let ratio = |n: u64, d: u64| (d > 0).then(|| n as f64 / d as f64);
    let versions: Vec<VersionRow> = versions
        .into_iter()
        .map(|(version, a)| VersionRow {
            version,
            turns: a.turns,
            sessions: a.sessions.len() as u64,
            judged: a.judged,
            reward_mean: (a.judged > 0).then(|| a.reward_sum as f64 / a.judged as f64),
            hint_rate: ratio(a.hints, a.judged),
            failed_vote_rate: ratio(a.failed, a.votes),
        })
        .collect();
    let steps: Vec<StepRow> = steps.into_values().collect();
    let serving_version = live
        .as_ref()
        .map(|l| l.version)
        .or_else(|| steps.iter().map(|s| s.version).max());
    let dir = records_dir.display();
    let message = if files.is_empty() {
        Some(format!(
            "No records yet in {dir}: the job has not recorded a turn or a step (or this is not \
             a run directory)."
        ))
    } else if steps.is_empty() && versions.is_empty() {
        Some(format!(
            "No trainer step or judged turn in {dir} yet: the plots fill in as the job records \
             them."
        ))
    } else if steps.is_empty() {
        Some("No trainer step yet: loss and KL appear after the first one.".into())
    } else {
        None
    };
    DashboardData {
        message,
        steps,
        versions,
        recent,
        serving_version,
        live,
        torn_lines,
        skipped_records,
        problems,
    }
}

/// The record files of a run (`<run>/records/*.jsonl`), read again only when changed.
pub struct DashboardSource {
    run_dir: Option<PathBuf>,
    cache: Mutex<HashMap<PathBuf, CachedFile>>,
}

struct CachedFile {
    len: u64,
    modified: Option<SystemTime>,
    file: Arc<RecordFile>,
}

impl DashboardSource {
    /// The dashboard of the run in `run_dir`; `None` for a server with no run (only live data).
    pub fn new(run_dir: Option<PathBuf>) -> Self {
        DashboardSource {
            run_dir,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The run directory.
    pub fn run_dir(&self) -> Option<&Path> {
        self.run_dir.as_deref()
    }

    fn read(&self, path: &Path) -> Result<Arc<RecordFile>, String> {
        let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
        let (len, modified) = (meta.len(), meta.modified().ok());
        if let Some(c) = self.cache.lock().unwrap().get(path) {
            if c.len == len && c.modified == modified {
                return Ok(c.file.clone());
            }
        }
        let mut file = read_records(path).map_err(|e| match e {
            ReadRecordsError::Io { source, .. } => source.to_string(),
            e => e.to_string(),
        })?;
        // Only the kinds the page shows are kept (sample records hold every token id).
        file.lines
            .retain(|l| matches!(l.kind.as_str(), "trainer_step" | "judge"));
        let file = Arc::new(file);
        self.cache.lock().unwrap().insert(
            path.to_path_buf(),
            CachedFile {
                len,
                modified,
                file: file.clone(),
            },
        );
        Ok(file)
    }

    /// The dashboard now (blocking IO: call it off the async threads).
    pub fn data(&self, live: Option<Live>) -> DashboardData {
        let Some(run) = &self.run_dir else {
            let mut d = build(Path::new("-"), &[], live);
            d.message = Some(
                "This server only serves (no training job): the plots stay empty; the version \
                 and the counters are live."
                    .into(),
            );
            return d;
        };
        let dir = run.join("records");
        let mut paths: Vec<PathBuf> = match std::fs::read_dir(&dir) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                .collect(),
            Err(_) => Vec::new(),
        };
        // `<job>.v<version:08>.jsonl`: the name's order is the versions' order.
        paths.sort();
        let files: Vec<_> = paths
            .into_iter()
            .map(|p| {
                let f = self.read(&p);
                (p, f)
            })
            .collect();
        build(&dir, &files, live)
    }
}

/// The page, as served.
pub fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // Nothing but this page's own script and style, and requests to its own origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:",
            ),
        ],
        PAGE,
    )
        .into_response()
}

/// The data endpoint's answer for `source`, with `live` when a gateway serves it.
pub async fn data_response(source: Arc<DashboardSource>, live: Option<Live>) -> Response {
    match tokio::task::spawn_blocking(move || source.data(live)).await {
        Ok(d) => ([(header::CACHE_CONTROL, "no-store")], axum::Json(d)).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading the run failed: {e}"),
        )
            .into_response(),
    }
}

/// The answer to a data request without a valid key.
pub fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        axum::Json(serde_json::json!({"error": {
            "message": "missing or invalid API key: send Authorization: Bearer <key>",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }})),
    )
        .into_response()
}

#[derive(Clone)]
struct Standalone {
    source: Arc<DashboardSource>,
    keys: Arc<ApiKeys>,
}

/// The routes of `clawrl dashboard`: the page, and the data behind `keys`.
pub fn standalone_router(source: Arc<DashboardSource>, keys: ApiKeys) -> axum::Router {
    use axum::extract::State;
    use axum::routing::get;
    async fn data(State(s): State<Standalone>, headers: HeaderMap) -> Response {
        if s.keys.check(&headers).is_none() {
            return unauthorized();
        }
        data_response(s.source.clone(), None).await
    }
    axum::Router::new()
        .route("/dashboard", get(|| async { page() }))
        .route("/dashboard/data", get(data))
        .with_state(Standalone {
            source,
            keys: Arc::new(keys),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clawrl_actors::loops::recorder::parse_records;
    use serde_json::json;

    fn judge_line(version: u64, session: &str, reward: i8, scores: &[Option<i8>]) -> String {
        let votes: Vec<_> = scores
            .iter()
            .map(|s| json!({"kind": "eval", "score": s, "hint": null, "raw": "", "error": null}))
            .collect();
        json!({"version": version, "kind": "judge", "record": {
            "session_id": session, "turn": 1, "votes": votes, "reward": reward,
            "hint_accepted": reward > 0, "hint": if reward > 0 { Some("say why") } else { None },
            "teacher_version": null, "unjudged": null,
        }})
        .to_string()
    }

    fn step_line(step: u64, loss: f64) -> String {
        let e = StepEvent {
            job: "j".into(),
            step,
            version: step,
            loss,
            pg_loss: loss - 0.5,
            kl: 0.5,
            clip_fraction: 0.0,
            grad_norm: 1.0,
            opd_loss: Default::default(),
            opd_samples: 0,
            old_recomputed: true,
            logprob_gap: None,
            kept: 2,
            importance_weighted: 0,
            importance: None,
            dropped_stale: 0,
            oldest_version: 0,
            tokens: 8,
            packing_ratio: 1.0,
            step_ms: 3.0,
            export_ms: 0.0,
            publish_ms: 0.0,
            wall_time: 1000.0 + step as f64,
            stats: Default::default(),
        };
        json!({"version": step, "kind": "trainer_step", "record": e}).to_string()
    }

    fn file(name: &str, text: &str) -> (PathBuf, Result<Arc<RecordFile>, String>) {
        let p = PathBuf::from(name);
        let f = parse_records(&p, text)
            .map(Arc::new)
            .map_err(|e| e.to_string());
        (p, f)
    }

    #[test]
    fn steps_and_versions_come_from_the_records() {
        let v0 = format!(
            "{}\n{}\n{}\n",
            judge_line(0, "a", 1, &[Some(1), None]),
            judge_line(0, "b", -1, &[Some(-1)]),
            json!({"version": 0, "kind": "sample", "record": {}}),
        );
        let v1 = format!(
            "{}\n{}\n{}\n{}",
            step_line(1, 2.0),
            judge_line(1, "a", 1, &[Some(1)]),
            step_line(2, 1.5),
            "{\"version\":1,\"kind\":\"jud" // torn: skipped
        );
        let files = [
            file("j.v00000000.jsonl", &v0),
            file("j.v00000001.jsonl", &v1),
        ];
        let d = build(Path::new("run/records"), &files, None);
        assert_eq!(d.message, None);
        assert_eq!(d.torn_lines, 1);
        assert_eq!(d.steps.len(), 2);
        assert_eq!(
            (
                d.steps[0].step,
                d.steps[0].loss,
                d.steps[0].kl,
                d.steps[0].wall_time
            ),
            (1, 2.0, 0.5, 1001.0)
        );
        assert_eq!(d.steps[1].pg_loss, 1.0);
        assert_eq!(d.versions.len(), 2);
        let v = &d.versions[0];
        assert_eq!((v.version, v.turns, v.sessions, v.judged), (0, 2, 2, 2));
        assert_eq!(v.reward_mean, Some(0.0));
        assert_eq!(v.hint_rate, Some(0.5));
        assert_eq!(v.failed_vote_rate, Some(1.0 / 3.0));
        assert_eq!(d.versions[1].reward_mean, Some(1.0));
        assert_eq!(d.serving_version, Some(2));
        assert_eq!(d.recent.len(), 3);
        assert_eq!(d.recent[2].version, 1);
        assert_eq!(d.recent[0].votes[1].score, None);
        assert_eq!(d.recent[0].hint.as_deref(), Some("say why"));

        // A gateway's live version wins over the records'.
        let live = Live {
            model: "m".into(),
            version: 5,
            sessions_open: 1,
            sessions_started: 2,
            main_turns: 3,
        };
        assert_eq!(
            build(Path::new("r"), &files, Some(live)).serving_version,
            Some(5)
        );
    }

    #[test]
    fn an_empty_or_half_written_run_gives_an_empty_dashboard_with_a_message() {
        let d = build(Path::new("run/records"), &[], None);
        assert!(d.steps.is_empty() && d.versions.is_empty() && d.recent.is_empty());
        assert!(d.message.unwrap().contains("No records yet in run/records"));

        // One file holding only a torn first line.
        let files = [file("j.v00000000.jsonl", "{\"version\":0,\"ki")];
        let d = build(Path::new("run/records"), &files, None);
        assert!(d.steps.is_empty());
        assert_eq!(d.torn_lines, 1);
        assert!(d
            .message
            .unwrap()
            .contains("No trainer step or judged turn"));

        // An unreadable file is named; the others still count.
        let files = [
            (
                PathBuf::from("j.v00000000.jsonl"),
                Err("permission denied".into()),
            ),
            file("j.v00000001.jsonl", &format!("{}\n", step_line(1, 1.0))),
        ];
        let d = build(Path::new("r"), &files, None);
        assert_eq!(d.steps.len(), 1);
        assert_eq!(
            d.problems,
            vec!["j.v00000000.jsonl: permission denied".to_string()]
        );
    }

    #[test]
    fn a_source_reads_a_run_dir_and_sees_lines_appended_later() {
        let dir = tempfile::tempdir().unwrap();
        let src = DashboardSource::new(Some(dir.path().to_path_buf()));
        assert!(src.data(None).message.unwrap().contains("No records yet"));
        let records = dir.path().join("records");
        std::fs::create_dir_all(&records).unwrap();
        let path = records.join("j.v00000001.jsonl");
        std::fs::write(&path, format!("{}\n{{\"version\":1", step_line(1, 1.0))).unwrap();
        let d = src.data(None);
        assert_eq!((d.steps.len(), d.torn_lines), (1, 1));
        std::fs::write(
            &path,
            format!("{}\n{}\n", step_line(1, 1.0), step_line(2, 0.5)),
        )
        .unwrap();
        let d = src.data(None);
        assert_eq!((d.steps.len(), d.torn_lines), (2, 0));
    }
}

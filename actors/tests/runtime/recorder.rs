//! The recorder: records rotate into one JSONL file per weight version in acceptance order; a
//! full queue is an explicit, counted refusal (never a silent drop); stopping the actor writes
//! every accepted record before it returns, and later records are refused as closed.

use std::collections::BTreeMap;
use std::path::Path;

use clawrl_actors::loops::recorder::RecordError;
use clawrl_actors::loops::{Recorder, RecorderConfig, RecorderHandle, RecorderMsg};
use ractor::{Actor, ActorRef};
use serde_json::Value;

async fn start(
    dir: &Path,
    capacity: usize,
    max_open: usize,
) -> (ActorRef<RecorderMsg>, RecorderHandle) {
    let mut cfg = RecorderConfig::new(dir, "job-7");
    cfg.capacity = capacity;
    cfg.max_open = max_open;
    let (actor, _) = Actor::spawn(None, Recorder, cfg).await.unwrap();
    let handle = ractor::call!(actor, RecorderMsg::Handle).unwrap();
    (actor, handle)
}

/// `version → [(kind, seq)]` from every file of the directory, checking names and envelopes.
fn read(dir: &Path) -> BTreeMap<u64, Vec<(String, u64)>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let v: u64 = name
            .strip_prefix("job-7.v")
            .and_then(|s| s.strip_suffix(".jsonl"))
            .unwrap_or_else(|| panic!("unexpected file {name}"))
            .parse()
            .unwrap();
        let lines: Vec<(String, u64)> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| {
                let j: Value = serde_json::from_str(l).unwrap();
                assert_eq!(j["version"], v, "{name}: {l}");
                (
                    j["kind"].as_str().unwrap().to_string(),
                    j["record"]["seq"].as_u64().unwrap(),
                )
            })
            .collect();
        out.insert(v, lines);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_rotate_per_version_in_order_and_late_records_join_their_version() {
    let dir = tempfile::tempdir().unwrap();
    // Two open files at most, so version 1 is closed and reopened (append) by the late record.
    let (actor, h) = start(dir.path(), 64, 2).await;
    let plan: Vec<(u64, &str)> = vec![
        (1, "turn"),
        (1, "judge"),
        (2, "turn"),
        (1, "turn"),
        (2, "train_step"),
        (3, "turn"),
        (3, "judge"),
        (1, "judge"),
        (3, "turn"),
    ];
    for (seq, (v, kind)) in plan.iter().enumerate() {
        h.record(*v, kind, &serde_json::json!({ "seq": seq }))
            .await
            .unwrap();
    }
    h.flush().await.unwrap();
    let files = read(dir.path());
    let mut expected: BTreeMap<u64, Vec<(String, u64)>> = BTreeMap::new();
    for (seq, (v, kind)) in plan.iter().enumerate() {
        expected
            .entry(*v)
            .or_default()
            .push((kind.to_string(), seq as u64));
    }
    assert_eq!(files, expected);
    let s = h.stats();
    assert_eq!(
        (s.accepted, s.written, s.write_errors, s.queued()),
        (9, 9, 0, 0)
    );
    assert!(s.files_opened >= 4, "version 1 was reopened: {s:?}");
    actor.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_a_counted_refusal_and_every_accepted_record_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (actor, h) = start(dir.path(), 1, 4).await;
    let attempts = 20_000u64;
    let mut accepted = Vec::new();
    let mut full = 0u64;
    for seq in 0..attempts {
        match h.try_record(seq / 5_000, "turn", &serde_json::json!({ "seq": seq })) {
            Ok(()) => accepted.push(seq),
            Err(RecordError::Full { capacity: 1 }) => full += 1,
            Err(e) => panic!("{e}"),
        }
    }
    actor.stop_and_wait(None, None).await.unwrap();
    let s = h.stats();
    assert!(full > 0, "a one-slot queue never filled: {s:?}");
    assert_eq!((s.accepted, s.rejected_full), (accepted.len() as u64, full));
    assert_eq!((s.written, s.write_errors), (s.accepted, 0));
    let written: Vec<u64> = read(dir.path())
        .into_values()
        .flatten()
        .map(|(_, seq)| seq)
        .collect();
    assert_eq!(
        written, accepted,
        "the files hold exactly the accepted records, in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_writes_everything_accepted_and_then_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let (actor, h) = start(dir.path(), 16, 4).await;
    // A producer that waits for room keeps going while the actor stops.
    let producer = {
        let h = h.clone();
        tokio::spawn(async move {
            let mut accepted = Vec::new();
            for seq in 0..50_000u64 {
                match h
                    .record(7, "turn", &serde_json::json!({ "seq": seq }))
                    .await
                {
                    Ok(()) => accepted.push(seq),
                    Err(RecordError::Closed) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            accepted
        })
    };
    while h.stats().accepted < 1_000 {
        tokio::task::yield_now().await;
    }
    actor.stop_and_wait(None, None).await.unwrap();
    let accepted = producer.await.unwrap();
    let s = h.stats();
    assert_eq!(s.accepted, accepted.len() as u64);
    assert_eq!((s.written, s.write_errors), (s.accepted, 0), "{s:?}");
    let written: Vec<u64> = read(dir.path())
        .into_values()
        .flatten()
        .map(|(_, seq)| seq)
        .collect();
    assert_eq!(written, accepted);
    assert!(matches!(
        h.try_record(7, "turn", &1),
        Err(RecordError::Closed)
    ));
    assert!(h.stats().rejected_closed >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = RecorderConfig::new(dir.path(), "../escape");
    let err = Actor::spawn(None, Recorder, cfg).await.unwrap_err();
    assert!(err.to_string().contains("../escape"), "{err}");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let err = Actor::spawn(None, Recorder, RecorderConfig::new(file.join("sub"), "j"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("a-file"), "{err}");
}

/// A crash mid-write leaves a torn last line: the recorder cuts it when it opens the file
/// (counted), appends after the last complete line, and every line then parses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_last_line_is_cut_counted_and_appending_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("job-7.v00000003.jsonl");
    let whole = r#"{"version":3,"kind":"turn","record":{"seq":0}}"#;
    std::fs::write(&file, format!("{whole}\n{{\"version\":3,\"kind\":\"tu")).unwrap();
    // A file that is one torn line and nothing else is emptied.
    let lone = dir.path().join("job-7.v00000004.jsonl");
    std::fs::write(&lone, r#"{"version":4,"ki"#).unwrap();
    let (actor, h) = start(dir.path(), 64, 4).await;
    h.record(3, "turn", &serde_json::json!({"seq": 1}))
        .await
        .unwrap();
    h.record(4, "turn", &serde_json::json!({"seq": 2}))
        .await
        .unwrap();
    h.flush().await.unwrap();
    assert_eq!(h.stats().torn_lines_cut, 2, "{:?}", h.stats());
    let got = read(dir.path());
    assert_eq!(got[&3], vec![("turn".into(), 0), ("turn".into(), 1)]);
    assert_eq!(got[&4], vec![("turn".into(), 2)]);
    // Files that end cleanly are left alone.
    actor.stop_and_wait(None, None).await.unwrap();
    let (actor, h) = start(dir.path(), 64, 4).await;
    h.record(3, "turn", &serde_json::json!({"seq": 3}))
        .await
        .unwrap();
    h.flush().await.unwrap();
    assert_eq!(h.stats().torn_lines_cut, 0);
    assert_eq!(read(dir.path())[&3].len(), 3);
    actor.stop_and_wait(None, None).await.unwrap();
}

/// At start the recorder reads every record file in its directory, whatever its prefix (a
/// re-run records under a new one): it cuts a torn tail the crashed run left, and records as
/// `lost` (once, counted) each turn recorded without a judge record; a second start finds
/// nothing left to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_cuts_torn_files_of_any_prefix_and_records_unjudged_turns_as_lost() {
    let dir = tempfile::tempdir().unwrap();
    let turn = |v: u64, s: &str, t: u64| {
        format!(r#"{{"version":{v},"kind":"turn","record":{{"session_id":"{s}","turn":{t}}}}}"#)
    };
    let judge = |v: u64, s: &str, t: u64| {
        format!(r#"{{"version":{v},"kind":"judge","record":{{"session_id":"{s}","turn":{t}}}}}"#)
    };
    // The crashed run `job-1`: a0 judged, a1 and b0 not, and a torn line at the end.
    let crashed = dir.path().join("job-1.v00000002.jsonl");
    std::fs::write(
        &crashed,
        format!(
            "{}\n{}\n{}\n{}\n{{\"version\":2,\"ki",
            turn(2, "a", 0),
            judge(2, "a", 0),
            turn(2, "a", 1),
            turn(2, "b", 0)
        ),
    )
    .unwrap();
    let mut cfg = RecorderConfig::new(dir.path(), "job-2");
    cfg.capacity = 64;
    let (actor, _) = Actor::spawn(None, Recorder, cfg.clone()).await.unwrap();
    let h = ractor::call!(actor, RecorderMsg::Handle).unwrap();
    h.flush().await.unwrap();
    let s = h.stats();
    assert_eq!((s.torn_lines_cut, s.lost_by_crash), (1, 2), "{s:?}");
    assert_eq!((s.accepted, s.written), (2, 2), "{s:?}");
    let text = std::fs::read_to_string(&crashed).unwrap();
    assert!(text.ends_with('\n') && text.lines().count() == 4, "{text}");
    let lost = clawrl_actors::loops::read_records(&dir.path().join("job-2.v00000002.jsonl"))
        .unwrap()
        .lines;
    let keys: Vec<(String, u64)> = lost
        .iter()
        .map(|l| {
            assert_eq!(l.kind, "lost");
            (
                l.record["session_id"].as_str().unwrap().to_string(),
                l.record["turn"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(keys, vec![("a".into(), 1), ("b".into(), 0)]);
    actor.stop_and_wait(None, None).await.unwrap();
    // Counted once: the next start finds every turn settled and no torn line.
    let (actor, _) = Actor::spawn(None, Recorder, cfg).await.unwrap();
    let h = ractor::call!(actor, RecorderMsg::Handle).unwrap();
    h.flush().await.unwrap();
    let s = h.stats();
    assert_eq!((s.torn_lines_cut, s.lost_by_crash, s.written), (0, 0, 0));
    actor.stop_and_wait(None, None).await.unwrap();
}

/// Written lines are fsynced on the interval without anyone asking for a flush, and record
/// files are private to their owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_are_fsynced_on_the_interval_and_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RecorderConfig::new(dir.path(), "job-7");
    cfg.sync_interval = std::time::Duration::from_millis(50);
    let (actor, _) = Actor::spawn(None, Recorder, cfg).await.unwrap();
    let h = ractor::call!(actor, RecorderMsg::Handle).unwrap();
    h.try_record(1, "turn", &serde_json::json!({"seq": 0}))
        .unwrap();
    // Waits for the condition (bounded), never for a guessed time.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while h.stats().syncs == 0 {
        assert!(std::time::Instant::now() < deadline, "never fsynced");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(h.stats().written, 1);
    let mode = std::fs::metadata(dir.path().join("job-7.v00000001.jsonl"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    actor.stop_and_wait(None, None).await.unwrap();
}

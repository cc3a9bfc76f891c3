//! The training scalars of a run, derived from its records and written to TensorBoard event
//! files under `<out>/tb/`.
//!
//! Per trainer step `k` (from a `trainer_step` record): the loss and its parts, clip fraction,
//! gradient norm, the rollout-vs-trainer log-prob gap, samples trained and dropped as stale,
//! the version and the step's time, all at step `k`. Per judged turn (a `judge` record),
//! aggregated per step: the turns judged since step `k − 1` give, at step `k`, their mean reward
//! and hint-accepted rate (over turns that were judged, not those left unjudged) and the
//! failed-vote rate (over every vote). Turns judged after the last step wait for the next one.
//!
//! [`ScalarLog`] is the pure rule (records in, scalars out); [`TensorBoardTap`] feeds it from a
//! job's [`Recorder`](clawrl_actors::loops::Recorder) and writes what it returns. The
//! in-process experiment drivers, which keep no records, feed a [`ScalarWriter`] directly.

use std::path::{Path, PathBuf};

use clawrl_actors::loops::{LogprobGap, RecordLine, RecordTap, RecorderHandle, StepEvent};

use super::events::{EventWriter, EventsError};
use crate::judge::votes::JudgedTurnRecord;
use crate::train::learner::StepMetrics;

/// The run's TensorBoard directory: `<out>/tb`.
pub fn tb_dir(out: &Path) -> PathBuf {
    out.join("tb")
}

/// Tags of the per-step scalars.
pub mod tags {
    /// Total loss.
    pub const LOSS: &str = "train/loss";
    /// Clipped policy-gradient term.
    pub const PG_LOSS: &str = "train/pg_loss";
    /// KL estimate.
    pub const KL: &str = "train/kl";
    /// Fraction of tokens where the clip was active.
    pub const CLIP_FRACTION: &str = "train/clip_fraction";
    /// Gradient norm before clipping.
    pub const GRAD_NORM: &str = "train/grad_norm";
    /// Mean |rollout − trainer| log-prob (only when samples carried rollout log-probs).
    pub const LOGPROB_GAP: &str = "train/logprob_gap";
    /// Largest |rollout − trainer| log-prob of the step (likewise).
    pub const LOGPROB_GAP_MAX: &str = "train/logprob_gap_max";
    /// Samples trained in the step.
    pub const SAMPLES_TRAINED: &str = "train/samples_trained";
    /// Samples dropped as stale while the step's batch was formed.
    pub const SAMPLES_DROPPED_STALE: &str = "train/samples_dropped_stale";
    /// The weight version after the step.
    pub const VERSION: &str = "train/version";
    /// Milliseconds of the optimizer step.
    pub const STEP_MS: &str = "train/step_ms";
    /// Tokens the forward pass computed over tokens the batch held (below 1: shared prefixes
    /// ran once).
    pub const PACKING_RATIO: &str = "train/packing_ratio";
    /// Mean reward of the turns judged since the previous step.
    pub const REWARD_MEAN: &str = "judge/reward_mean";
    /// Of those turns, the fraction whose hint was accepted.
    pub const HINT_ACCEPTED_RATE: &str = "judge/hint_accepted_rate";
    /// Of their votes, the fraction that failed.
    pub const FAILED_VOTE_RATE: &str = "judge/failed_vote_rate";
    /// How many turns were judged since the previous step.
    pub const TURNS_JUDGED: &str = "judge/turns_judged";
}

/// What one trainer step contributes.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPoint {
    /// Optimizer steps applied, this one included.
    pub step: u64,
    /// The weight version after the step.
    pub version: u64,
    /// Total loss.
    pub loss: f64,
    /// Policy-gradient term.
    pub pg_loss: f64,
    /// KL estimate.
    pub kl: f64,
    /// Clip fraction.
    pub clip_fraction: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Mean |rollout − trainer| log-prob, when measured.
    pub logprob_gap: Option<LogprobGap>,
    /// Samples trained.
    pub trained: u64,
    /// Samples dropped as stale.
    pub dropped_stale: u64,
    /// Milliseconds of the optimizer step.
    pub step_ms: f64,
    /// Tokens computed over tokens held (0 when the record predates it).
    pub packing_ratio: f64,
    /// When the step ended (seconds since the Unix epoch; 0 when unknown).
    pub wall_time: f64,
}

impl StepPoint {
    /// The point of a trainer's step record.
    pub fn of_event(e: &StepEvent) -> Self {
        StepPoint {
            step: e.step,
            version: e.version,
            loss: e.loss,
            pg_loss: e.pg_loss,
            kl: e.kl,
            clip_fraction: e.clip_fraction,
            grad_norm: e.grad_norm,
            logprob_gap: e.logprob_gap,
            trained: e.kept as u64,
            dropped_stale: e.dropped_stale as u64,
            step_ms: e.step_ms,
            packing_ratio: e.packing_ratio,
            wall_time: e.wall_time,
        }
    }
}

impl StepPoint {
    /// The point of a step the in-process experiment drivers take directly on a learner:
    /// `trained` samples, none dropped (they keep no staleness bound), `step_ms` long, ended
    /// now.
    pub fn of_metrics(m: &StepMetrics, trained: usize, step_ms: f64) -> Self {
        StepPoint {
            step: m.step,
            version: m.version,
            loss: m.loss,
            pg_loss: m.pg_loss,
            kl: m.kl,
            clip_fraction: m.clip_fraction,
            grad_norm: m.grad_norm,
            logprob_gap: m.logprob_gap,
            trained: trained as u64,
            dropped_stale: 0,
            step_ms,
            packing_ratio: m.packing_ratio,
            wall_time: unix_now(),
        }
    }
}

/// What one judged turn contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JudgedPoint {
    /// The turn was judged (it had a next state); an unjudged turn only adds its votes.
    pub judged: bool,
    /// The reward (−1, 0, 1).
    pub reward: i8,
    /// A hint was accepted.
    pub hint_accepted: bool,
    /// Votes asked.
    pub votes: usize,
    /// Of those, votes that failed (gave no score).
    pub failed_votes: usize,
}

impl JudgedPoint {
    /// The point of a judged-turn record.
    pub fn of_record(r: &JudgedTurnRecord) -> Self {
        JudgedPoint {
            judged: r.unjudged.is_none(),
            reward: r.reward,
            hint_accepted: r.hint_accepted,
            votes: r.votes.len(),
            failed_votes: r.votes.iter().filter(|v| v.score.is_none()).count(),
        }
    }
}

/// One scalar to write.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    /// Its tag (see [`tags`]).
    pub tag: &'static str,
    /// The trainer step it belongs to.
    pub step: u64,
    /// Its value.
    pub value: f64,
    /// When (seconds since the Unix epoch).
    pub wall_time: f64,
}

/// Turns scalars out of records, in record order.
#[derive(Debug, Clone, Default)]
pub struct ScalarLog {
    turns: u64,
    reward_sum: i64,
    hints: u64,
    votes: u64,
    failed_votes: u64,
    /// Records of a known kind that did not parse as that kind (left out, counted).
    pub unparsed: u64,
}

impl ScalarLog {
    /// Counts a judged turn towards the next step.
    pub fn judged(&mut self, j: &JudgedPoint) {
        if j.judged {
            self.turns += 1;
            self.reward_sum += i64::from(j.reward);
            self.hints += u64::from(j.hint_accepted);
        }
        self.votes += j.votes as u64;
        self.failed_votes += j.failed_votes as u64;
    }

    /// The scalars of step `p`: the step's own, then (when any turn or vote arrived since the
    /// previous step) the judge's aggregates, which start again from zero. `now` stands in for
    /// an unknown wall time.
    pub fn step(&mut self, p: &StepPoint, now: f64) -> Vec<Scalar> {
        let wall_time = if p.wall_time > 0.0 { p.wall_time } else { now };
        let at = |tag, value| Scalar {
            tag,
            step: p.step,
            value,
            wall_time,
        };
        let mut out = vec![
            at(tags::LOSS, p.loss),
            at(tags::PG_LOSS, p.pg_loss),
            at(tags::KL, p.kl),
            at(tags::CLIP_FRACTION, p.clip_fraction),
            at(tags::GRAD_NORM, p.grad_norm),
        ];
        if let Some(gap) = &p.logprob_gap {
            out.push(at(tags::LOGPROB_GAP, gap.mean_abs));
            out.push(at(tags::LOGPROB_GAP_MAX, gap.max_abs));
        }
        out.extend([
            at(tags::SAMPLES_TRAINED, p.trained as f64),
            at(tags::SAMPLES_DROPPED_STALE, p.dropped_stale as f64),
            at(tags::VERSION, p.version as f64),
            at(tags::STEP_MS, p.step_ms),
        ]);
        if p.packing_ratio > 0.0 {
            out.push(at(tags::PACKING_RATIO, p.packing_ratio));
        }
        if self.turns > 0 {
            let n = self.turns as f64;
            out.push(at(tags::REWARD_MEAN, self.reward_sum as f64 / n));
            out.push(at(tags::HINT_ACCEPTED_RATE, self.hints as f64 / n));
            out.push(at(tags::TURNS_JUDGED, n));
        }
        if self.votes > 0 {
            out.push(at(
                tags::FAILED_VOTE_RATE,
                self.failed_votes as f64 / self.votes as f64,
            ));
        }
        let unparsed = self.unparsed;
        *self = ScalarLog {
            unparsed,
            ..ScalarLog::default()
        };
        out
    }

    /// Feeds one record: a `judge` record counts towards the next step, a `trainer_step`
    /// record returns that step's scalars; other kinds are not scalars.
    pub fn observe(&mut self, line: &RecordLine, now: f64) -> Vec<Scalar> {
        match line.kind.as_str() {
            "judge" => {
                match serde_json::from_value::<JudgedTurnRecord>(line.record.clone()) {
                    Ok(r) => self.judged(&JudgedPoint::of_record(&r)),
                    Err(_) => self.unparsed += 1,
                }
                Vec::new()
            }
            "trainer_step" => match serde_json::from_value::<StepEvent>(line.record.clone()) {
                Ok(e) => self.step(&StepPoint::of_event(&e), now),
                Err(_) => {
                    self.unparsed += 1;
                    Vec::new()
                }
            },
            _ => Vec::new(),
        }
    }
}

/// Seconds since the Unix epoch now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes a run's scalars as TensorBoard events.
pub struct ScalarWriter {
    log: ScalarLog,
    events: EventWriter,
    /// The first write error (later writes are not attempted; the job goes on).
    failed: Option<String>,
}

impl ScalarWriter {
    /// A new event file under `dir`.
    pub fn create(dir: &Path) -> Result<Self, EventsError> {
        Ok(ScalarWriter {
            log: ScalarLog::default(),
            events: EventWriter::create(dir, unix_now())?,
            failed: None,
        })
    }

    /// The log (to feed turns and steps that are not records).
    pub fn log(&mut self) -> &mut ScalarLog {
        &mut self.log
    }

    /// Writes `scalars`; a failure is logged once and stops later writes.
    pub fn write(&mut self, scalars: &[Scalar]) {
        if self.failed.is_some() {
            return;
        }
        let result = scalars
            .iter()
            .try_for_each(|s| self.events.scalar(s.tag, s.step, s.value, s.wall_time));
        if let Err(e) = result {
            tracing::error!("TensorBoard scalars are no longer written: {e}");
            self.failed = Some(e.to_string());
        }
    }

    /// Writes the scalars of step `p` (with the turns judged since the previous step).
    pub fn step(&mut self, p: &StepPoint) {
        let scalars = self.log.step(p, unix_now());
        self.write(&scalars);
        self.flush();
    }

    /// Hands what was written to the OS.
    pub fn flush(&mut self) {
        if self.failed.is_none() {
            if let Err(e) = self.events.flush() {
                tracing::error!("TensorBoard scalars are no longer written: {e}");
                self.failed = Some(e.to_string());
            }
        }
    }
}

/// The [`RecordTap`] that keeps a job's TensorBoard scalars.
pub struct TensorBoardTap(pub ScalarWriter);

impl RecordTap for TensorBoardTap {
    fn record(&mut self, line: &RecordLine) {
        let scalars = self.0.log.observe(line, unix_now());
        self.0.write(&scalars);
    }

    fn flush(&mut self) {
        self.0.flush();
    }
}

/// Why a job's scalars could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The event file could not be created.
    #[error(transparent)]
    Events(#[from] EventsError),
    /// The recorder has stopped.
    #[error("installing the TensorBoard tap: {0}")]
    Recorder(#[from] clawrl_actors::loops::recorder::RecordError),
}

/// Makes the job whose records `rec` writes also write its scalars under `<out>/tb/`.
pub async fn tap_recorder(rec: &RecorderHandle, out: &Path) -> Result<PathBuf, TapError> {
    let writer = ScalarWriter::create(&tb_dir(out))?;
    let path = writer.events.path().to_path_buf();
    rec.tap(Box::new(TensorBoardTap(writer))).await?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn judge(reward: i8, hint: bool, scores: &[Option<i8>], unjudged: bool) -> RecordLine {
        let votes: Vec<_> = scores
            .iter()
            .map(|s| json!({"kind": "eval", "score": s, "hint": null, "raw": "", "error": null}))
            .collect();
        RecordLine {
            version: 0,
            kind: "judge".into(),
            record: json!({
                "session_id": "s", "turn": 0, "votes": votes, "reward": reward,
                "hint_accepted": hint, "hint": if hint { Some("do x") } else { None },
                "teacher_version": null,
                "unjudged": if unjudged { Some("no next state") } else { None },
            }),
        }
    }

    fn step(step: u64, gap: Option<f64>) -> RecordLine {
        RecordLine {
            version: step,
            kind: "trainer_step".into(),
            record: serde_json::to_value(StepEvent {
                job: "j".into(),
                step,
                version: step,
                loss: 1.5,
                pg_loss: 1.25,
                kl: 0.25,
                clip_fraction: 0.125,
                grad_norm: 3.0,
                opd_loss: Default::default(),
                opd_samples: 0,
                old_recomputed: true,
                logprob_gap: gap.map(|mean_abs| LogprobGap {
                    mean: -mean_abs,
                    mean_abs,
                    max_abs: 2.0 * mean_abs,
                    tokens: 10,
                }),
                kept: 4,
                importance_weighted: 0,
                importance: None,
                dropped_stale: 2,
                oldest_version: 0,
                tokens: 40,
                packing_ratio: 0.25,
                step_ms: 12.0,
                export_ms: 1.0,
                publish_ms: 1.0,
                wall_time: 100.0 + step as f64,
                stats: Default::default(),
            })
            .unwrap(),
        }
    }

    fn value(out: &[Scalar], tag: &str) -> Option<f64> {
        out.iter().find(|s| s.tag == tag).map(|s| s.value)
    }

    #[test]
    fn a_step_gives_its_scalars_and_the_judged_turns_since_the_last_step() {
        let mut log = ScalarLog::default();
        let eval_err = "judge records parse";
        for l in [
            judge(1, true, &[Some(1), None], false),
            judge(-1, false, &[Some(-1), Some(-1)], false),
            judge(0, false, &[], true),
        ] {
            assert!(log.observe(&l, 0.0).is_empty(), "{eval_err}");
        }
        let out = log.observe(&step(1, Some(0.5)), 7.0);
        assert_eq!(log.unparsed, 0, "{eval_err}");
        assert!(out.iter().all(|s| s.step == 1 && s.wall_time == 101.0));
        assert_eq!(value(&out, tags::LOSS), Some(1.5));
        assert_eq!(value(&out, tags::PG_LOSS), Some(1.25));
        assert_eq!(value(&out, tags::KL), Some(0.25));
        assert_eq!(value(&out, tags::CLIP_FRACTION), Some(0.125));
        assert_eq!(value(&out, tags::GRAD_NORM), Some(3.0));
        assert_eq!(value(&out, tags::LOGPROB_GAP), Some(0.5));
        assert_eq!(value(&out, tags::LOGPROB_GAP_MAX), Some(1.0));
        assert_eq!(value(&out, tags::SAMPLES_TRAINED), Some(4.0));
        assert_eq!(value(&out, tags::SAMPLES_DROPPED_STALE), Some(2.0));
        assert_eq!(value(&out, tags::VERSION), Some(1.0));
        assert_eq!(value(&out, tags::STEP_MS), Some(12.0));
        assert_eq!(value(&out, tags::PACKING_RATIO), Some(0.25));
        // Two judged turns (+1, −1), one with a hint; the unjudged one only adds no votes.
        assert_eq!(value(&out, tags::REWARD_MEAN), Some(0.0));
        assert_eq!(value(&out, tags::HINT_ACCEPTED_RATE), Some(0.5));
        assert_eq!(value(&out, tags::TURNS_JUDGED), Some(2.0));
        assert_eq!(value(&out, tags::FAILED_VOTE_RATE), Some(0.25));

        // The next step starts from zero: no turns, no judge scalars; no gap, no gap scalar.
        let out = log.observe(&step(2, None), 7.0);
        assert_eq!(value(&out, tags::REWARD_MEAN), None);
        assert_eq!(value(&out, tags::FAILED_VOTE_RATE), None);
        assert_eq!(value(&out, tags::LOGPROB_GAP), None);
        assert_eq!(out.len(), 10);
        log.observe(&judge(1, false, &[Some(1)], false), 0.0);
        let out = log.observe(&step(3, None), 7.0);
        assert_eq!(value(&out, tags::REWARD_MEAN), Some(1.0));
        assert_eq!(value(&out, tags::FAILED_VOTE_RATE), Some(0.0));
    }

    #[test]
    fn other_kinds_are_ignored_and_malformed_records_counted() {
        let mut log = ScalarLog::default();
        let other = RecordLine {
            version: 0,
            kind: "sample".into(),
            record: json!({}),
        };
        assert!(log.observe(&other, 0.0).is_empty());
        let bad = RecordLine {
            version: 0,
            kind: "trainer_step".into(),
            record: json!({"step": "one"}),
        };
        assert!(log.observe(&bad, 0.0).is_empty());
        assert_eq!(log.unparsed, 1);
        // A step without a wall time takes `now`.
        let mut s = step(1, None);
        s.record["wall_time"] = json!(0.0);
        assert!(log.observe(&s, 42.0).iter().all(|s| s.wall_time == 42.0));
    }
}

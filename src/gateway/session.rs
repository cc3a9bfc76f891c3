//! The session table: which turns become training records, and with which next state. Pure and
//! clock-free (`now` is an argument, docs/design.md §6); the server calls it under a lock and sends what
//! it returns to the record sink.
//!
//! Rules (docs/design.md §4):
//! - a request names its session (`X-Session-Id` / `session_id`); a main request without one
//!   continues the open session of its key whose served turn it extends (it resends that
//!   conversation: [`super::infer`] has the rule, [`SessionTable::infer`] the choice), and gets a
//!   fresh id when it extends none;
//! - sessions belong to the API key that opened them and the model id they talk to
//!   ([`Scope`]): the table is keyed by (scope, id), so the same id sent with another key or to
//!   another model is another session, and one key's requests never complete, end or see
//!   another key's turns, nor one model's another's;
//! - its turn type is `main` or `side` (`X-Turn-Type` / `turn_type`); when absent, a request
//!   that names a session is `main`, and one that does not takes the configured default
//!   (`main` unless configured otherwise);
//! - side turns are served and counted, never recorded, and never open a session;
//! - a main request is admitted first ([`SessionTable::admit`]): it may open a session only
//!   while its key has fewer than `max_sessions_per_key` sessions open or being opened; the
//!   session is opened when its turn has been served, so a refused or failed request leaves
//!   none behind ([`SessionTable::release`]);
//! - a main turn waits as the session's *pending* turn; on the next main request naming the
//!   session its last message becomes the pending turn's next state (if it is a `user` or
//!   `tool` message; otherwise the pending turn is closed as if the session ended); a request
//!   that extends the pending turn by inference gives every message after the turn's response
//!   as its next state ([`SessionTable::on_inferred`]);
//! - a request that extends an *older* turn of a session (an edit or a regeneration) closes the
//!   session's pending turn without a next state ([`TurnEnd::Superseded`], counted) and
//!   continues the session from there;
//! - a session ends on `X-Session-Done` or after the idle timeout; its pending turn is then
//!   recorded without a next state or dropped ([`EndPolicy`]), and counted either way.
//!
//! The table is bounded: at most `max_sessions_per_key` entries per scope, scopes are the
//! configured keys (one when none is configured), and a session remembers the transcripts of at
//! most [`TURNS_KEPT`] of its latest turns for inference.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::infer::{extends, Msg, Transcript};

/// The latest turns of a session whose transcripts are kept: a request can extend (edit or
/// regenerate from) one of these, not an older one.
pub const TURNS_KEPT: usize = 32;

/// Main-line (trained on) or side (served only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnType {
    /// A main-line turn: recorded for training.
    Main,
    /// A side turn: served, never recorded.
    Side,
}

impl std::str::FromStr for TurnType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "main" => Ok(Self::Main),
            "side" => Ok(Self::Side),
            other => Err(format!(
                "turn type must be \"main\" or \"side\", got {other:?}"
            )),
        }
    }
}

/// What happens to a session's pending turn when the session ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndPolicy {
    /// Record it without a next state (the judge sees no next state).
    Keep,
    /// Drop it.
    Drop,
}

/// Why a turn left the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnEnd {
    /// The next main request gave its next state.
    NextState,
    /// The next main request's last message was not a user or tool message.
    NoNextState,
    /// The client ended the session (`X-Session-Done`).
    SessionDone,
    /// The session was idle past the timeout.
    IdleTimeout,
    /// A request extended an older turn of the session (an edit or a regeneration).
    Superseded,
    /// The client left before the answer was whole: recorded as far as it went, never
    /// trained on.
    Abandoned,
    /// The process serving it stopped (a crash) while it waited for its next state: recorded
    /// from the served journal by the next start, never trained on.
    Lost,
}

/// Whose sessions: the API key a request authenticated with, as its index among the gateway's
/// keys (0 for every request when no key is configured), and the model id it talks to, as its
/// index among the gateway's models (0: the checkpoint itself). Session ids are chosen by
/// clients, so only (scope, id) names a session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    /// The API key's index.
    pub key: u32,
    /// The model id's index.
    pub model: u32,
}

impl Scope {
    /// Key `key` talking to the checkpoint itself.
    pub const fn key(key: u32) -> Self {
        Scope { key, model: 0 }
    }

    /// The same key talking to model `model`.
    pub const fn with_model(self, model: u32) -> Self {
        Scope { model, ..self }
    }
}

/// Session rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionConfig {
    /// Turn type of a request that names neither a session nor a turn type.
    pub default_turn_type: TurnType,
    /// A session with no request for this long ends.
    pub idle_timeout: Duration,
    /// What happens to a pending turn when its session ends.
    pub on_end: EndPolicy,
    /// Most sessions one scope may have open or being opened.
    pub max_sessions_per_key: usize,
}

/// One model id's sessions, as its dashboard shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ModelCounts {
    /// Sessions opened.
    pub started: u64,
    /// Sessions open now.
    pub open: u64,
    /// Main turns served.
    pub main_turns: u64,
}

/// Counters of the table, for `/metrics` and a job's summary. Every session opened is ended by
/// its client (`ended_done`), ended idle (`ended_idle`, shutdown included) or still open; every
/// main turn served is completed with a next state, kept or dropped without one, or still
/// pending in an open session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SessionStats {
    /// Sessions opened.
    pub started: u64,
    /// Sessions ended by `X-Session-Done`.
    pub ended_done: u64,
    /// Sessions ended by the idle timeout.
    pub ended_idle: u64,
    /// Main turns served.
    pub main_turns: u64,
    /// Side turns served (never recorded).
    pub side_turns: u64,
    /// Turns completed with a next state.
    pub with_next_state: u64,
    /// Last turns recorded without a next state.
    pub kept_without_next_state: u64,
    /// Last turns dropped.
    pub dropped: u64,
    /// Main requests refused because their key had `max_sessions_per_key` sessions.
    pub refused_full: u64,
    /// Main requests without a session id that continued a session by inference.
    pub inferred: u64,
    /// Pending turns closed because a request extended an older turn of their session.
    pub superseded: u64,
}

/// A main request was refused: its key already has as many sessions as it may.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{cap} sessions are already open for this API key (for all clients when no key is \
     configured), the most allowed (max_sessions_per_key = {cap}); end one with \
     X-Session-Done, continue an open session, or retry when an idle one has timed out"
)]
pub struct SessionsFull {
    /// The cap (`max_sessions_per_key`).
    pub cap: usize,
    /// When the first of the key's sessions ends by the idle timeout, if nothing touches it.
    pub retry_after: Duration,
}

/// A main request's hold on its session, from admission to the end of its turn: it keeps a
/// place under the key's cap for a session that is not open yet. Hand it back to
/// [`SessionTable::on_served`] when the turn was served or to [`SessionTable::release`] when it
/// was not.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an admission holds a place under the cap until it is served or released"]
pub struct Admission {
    scope: Scope,
    session_id: String,
}

impl Admission {
    /// The session's scope.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// The session id.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }
}

/// A turn handed back for recording; `T` is the server's turn data.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished<T> {
    /// The session.
    pub session_id: String,
    /// The turn.
    pub turn: T,
    /// The last message of the next state, if any.
    pub next_state: Option<serde_json::Value>,
    /// Every message of the next state, in order: the next main request's last message when it
    /// named the session, every message after this turn's response when it was inferred.
    pub next_messages: Vec<serde_json::Value>,
    /// Why it left the table.
    pub end: TurnEnd,
}

/// A request without a session id that extends a served turn ([`SessionTable::infer`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Inferred {
    /// The session it continues.
    pub session_id: String,
    /// The turn it extends.
    serial: u64,
    /// The messages after that turn's response, as sent.
    pub next_state: Vec<serde_json::Value>,
}

struct Session<T> {
    last_seen: Instant,
    pending: Option<T>,
    /// The serial of the pending turn (meaningless while none is pending).
    pending_serial: u64,
    /// The latest served turns (serial, transcript), oldest first.
    turns: VecDeque<(u64, Transcript)>,
}

/// One session id of a scope: open once a turn of it was served, and held while admitted main
/// requests of it run. It counts under the cap either way, and leaves the table when neither.
struct Entry<T> {
    open: Option<Session<T>>,
    in_flight: usize,
}

/// The table of open sessions.
pub struct SessionTable<T> {
    cfg: SessionConfig,
    scopes: HashMap<Scope, HashMap<String, Entry<T>>>,
    stats: SessionStats,
    /// Sessions opened and main turns served, by model index.
    by_model: HashMap<u32, ModelCounts>,
    /// Serial of the last served main turn, every scope together (the order of recency).
    serial: u64,
}

impl<T> SessionTable<T> {
    /// An empty table.
    pub fn new(cfg: SessionConfig) -> Self {
        Self {
            cfg,
            scopes: HashMap::new(),
            stats: SessionStats::default(),
            by_model: HashMap::new(),
            serial: 0,
        }
    }

    /// The rules.
    pub fn config(&self) -> SessionConfig {
        self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// One model id's sessions: opened, open now, and main turns served (every key together).
    pub fn model_counts(&self, model: u32) -> ModelCounts {
        let mut c = self.by_model.get(&model).copied().unwrap_or_default();
        c.open = self
            .scopes
            .iter()
            .filter(|(scope, _)| scope.model == model)
            .flat_map(|(_, m)| m.values())
            .filter(|e| e.open.is_some())
            .count() as u64;
        c
    }

    /// Open sessions, every scope together.
    pub fn open_sessions(&self) -> usize {
        self.scopes
            .values()
            .flat_map(|m| m.values())
            .filter(|e| e.open.is_some())
            .count()
    }

    /// Sessions of `scope` open or being opened (what the cap counts).
    pub fn held(&self, scope: Scope) -> usize {
        self.scopes.get(&scope).map_or(0, HashMap::len)
    }

    /// The turn type of a request: explicit wins; a named session means main; else the default.
    pub fn resolve_turn_type(&self, explicit: Option<TurnType>, named_session: bool) -> TurnType {
        match explicit {
            Some(t) => t,
            None if named_session => TurnType::Main,
            None => self.cfg.default_turn_type,
        }
    }

    /// Admits a main request of `session_id` under `scope`: always when the session is open or
    /// being opened already, else only while the scope holds fewer than `max_sessions_per_key`
    /// sessions.
    pub fn admit(
        &mut self,
        scope: Scope,
        session_id: &str,
        now: Instant,
    ) -> Result<Admission, SessionsFull> {
        let cap = self.cfg.max_sessions_per_key;
        let entries = self.scopes.entry(scope).or_default();
        if !entries.contains_key(session_id) && entries.len() >= cap {
            self.stats.refused_full += 1;
            let retry_after = self.first_expiry(scope, now);
            return Err(SessionsFull { cap, retry_after });
        }
        entries
            .entry(session_id.to_string())
            .or_insert(Entry {
                open: None,
                in_flight: 0,
            })
            .in_flight += 1;
        Ok(Admission {
            scope,
            session_id: session_id.to_string(),
        })
    }

    /// An admitted request was not served (refused, failed, or its client left): its hold ends,
    /// and a session it would have opened is never opened.
    pub fn release(&mut self, admission: Admission) {
        let Admission { scope, session_id } = admission;
        if let Some(e) = self.entry_mut(scope, &session_id) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        self.prune(scope, &session_id);
    }

    /// A request of (`scope`, `session_id`) arrives; an open session is touched, none is opened.
    /// For a main request, `last_message` (the request's last message) completes the session's
    /// pending turn. Returns turns to record.
    pub fn on_request(
        &mut self,
        scope: Scope,
        session_id: &str,
        turn_type: TurnType,
        last_message: Option<&serde_json::Value>,
        now: Instant,
    ) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let Some(s) = self.open_mut(scope, session_id) else {
            return out;
        };
        s.last_seen = s.last_seen.max(now);
        if turn_type == TurnType::Side {
            return out;
        }
        let Some(turn) = s.pending.take() else {
            return out;
        };
        let role = last_message
            .and_then(|m| m.get("role"))
            .and_then(|r| r.as_str());
        if matches!(role, Some("user") | Some("tool")) {
            self.stats.with_next_state += 1;
            out.push(Finished {
                session_id: session_id.to_string(),
                turn,
                next_state: last_message.cloned(),
                next_messages: last_message.into_iter().cloned().collect(),
                end: TurnEnd::NextState,
            });
        } else {
            self.close(session_id, turn, TurnEnd::NoNextState, &mut out);
        }
        out
    }

    /// The open session of `scope` that a main request without a session id continues: the one
    /// with a kept turn that `request` (its messages, as sent) extends by the [`super::infer`]
    /// rule. When it extends several turns, the one whose prompt it dropped the fewest messages
    /// of wins, then the most recently served one. Another scope's sessions are never
    /// considered.
    pub fn infer(&self, scope: Scope, request: &[serde_json::Value]) -> Option<Inferred> {
        let entries = self.scopes.get(&scope)?;
        let msgs: Vec<Msg> = request.iter().map(Msg::from_json).collect();
        let msgs = &msgs;
        let (_, at, serial, id) = entries
            .iter()
            .filter_map(|(id, e)| e.open.as_ref().map(|s| (id, s)))
            .flat_map(|(id, s)| {
                s.turns.iter().filter_map(move |(serial, tr)| {
                    extends(tr, msgs).map(|x| (x.rank(), x.at, *serial, id))
                })
            })
            .max_by_key(|(rank, _, serial, _)| (*rank, *serial))?;
        Some(Inferred {
            session_id: id.clone(),
            serial,
            next_state: request[at + 1..].to_vec(),
        })
    }

    /// A main request `inferred` to continue its session arrives (after its admission): when it
    /// extends the pending turn, its next state completes that turn; when it extends an older
    /// turn, the pending turn is closed without a next state ([`TurnEnd::Superseded`]). The
    /// session is touched. Returns turns to record.
    pub fn on_inferred(
        &mut self,
        scope: Scope,
        inferred: &Inferred,
        now: Instant,
    ) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let id = inferred.session_id.as_str();
        let Some(s) = self.open_mut(scope, id) else {
            return out;
        };
        s.last_seen = s.last_seen.max(now);
        let extends_pending = s.pending_serial == inferred.serial;
        let pending = s.pending.take();
        self.stats.inferred += 1;
        let Some(turn) = pending else {
            return out;
        };
        if extends_pending {
            self.stats.with_next_state += 1;
            out.push(Finished {
                session_id: id.to_string(),
                turn,
                next_state: inferred.next_state.last().cloned(),
                next_messages: inferred.next_state.clone(),
                end: TurnEnd::NextState,
            });
        } else {
            self.stats.superseded += 1;
            self.close(id, turn, TurnEnd::Superseded, &mut out);
        }
        out
    }

    /// The main turn of `admission` was served: the session is opened if it is not, and the
    /// turn becomes its pending turn (a still pending older one, from overlapping requests, is
    /// closed without a next state); its `transcript`, when given, is kept for inference. With
    /// `done`, the session ends now. Returns turns to record.
    pub fn on_served(
        &mut self,
        admission: Admission,
        turn: T,
        transcript: Option<Transcript>,
        done: bool,
        now: Instant,
    ) -> Vec<Finished<T>> {
        let Admission { scope, session_id } = admission;
        let mut out = Vec::new();
        self.stats.main_turns += 1;
        self.by_model.entry(scope.model).or_default().main_turns += 1;
        let entry = self
            .scopes
            .entry(scope)
            .or_default()
            .entry(session_id.clone())
            .or_insert(Entry {
                open: None,
                in_flight: 1,
            });
        entry.in_flight = entry.in_flight.saturating_sub(1);
        let opened = entry.open.is_none();
        let s = entry.open.get_or_insert(Session {
            last_seen: now,
            pending: None,
            pending_serial: 0,
            turns: VecDeque::new(),
        });
        s.last_seen = s.last_seen.max(now);
        self.serial += 1;
        let older = s.pending.replace(turn);
        s.pending_serial = self.serial;
        if let Some(tr) = transcript {
            if s.turns.len() == TURNS_KEPT {
                s.turns.pop_front();
            }
            s.turns.push_back((self.serial, tr));
        }
        if opened {
            self.stats.started += 1;
            self.by_model.entry(scope.model).or_default().started += 1;
        }
        if let Some(t) = older {
            self.close(&session_id, t, TurnEnd::NoNextState, &mut out);
        }
        if done {
            out.extend(self.end(scope, &session_id, TurnEnd::SessionDone));
        }
        out
    }

    /// A side turn of (`scope`, `session_id`) was served: counted; it opens no session. With
    /// `done`, the session, if open, ends now. Returns turns to record.
    pub fn on_side_served(
        &mut self,
        scope: Scope,
        session_id: &str,
        done: bool,
        now: Instant,
    ) -> Vec<Finished<T>> {
        self.stats.side_turns += 1;
        if let Some(s) = self.open_mut(scope, session_id) {
            s.last_seen = s.last_seen.max(now);
        }
        if done {
            return self.end(scope, session_id, TurnEnd::SessionDone);
        }
        Vec::new()
    }

    /// Ends (`scope`, `session_id`) now (`X-Session-Done` on a request that was not served, e.g.
    /// one that failed). Returns its pending turn if it is kept.
    pub fn end_session(&mut self, scope: Scope, session_id: &str) -> Vec<Finished<T>> {
        self.end(scope, session_id, TurnEnd::SessionDone)
    }

    /// Ends every session idle for at least the timeout at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Finished<T>> {
        let timeout = self.cfg.idle_timeout;
        let idle: Vec<(Scope, String)> = self
            .open_entries()
            .filter(|(_, _, s)| now.saturating_duration_since(s.last_seen) >= timeout)
            .map(|(scope, id, _)| (scope, id.clone()))
            .collect();
        let mut out = Vec::new();
        for (scope, id) in idle {
            out.extend(self.end(scope, &id, TurnEnd::IdleTimeout));
        }
        out
    }

    /// Ends every session (server shutdown), as an idle timeout would.
    pub fn end_all(&mut self) -> Vec<Finished<T>> {
        let ids: Vec<(Scope, String)> = self
            .open_entries()
            .map(|(scope, id, _)| (scope, id.clone()))
            .collect();
        let mut out = Vec::new();
        for (scope, id) in ids {
            out.extend(self.end(scope, &id, TurnEnd::IdleTimeout));
        }
        out
    }

    fn open_entries(&self) -> impl Iterator<Item = (Scope, &String, &Session<T>)> {
        self.scopes.iter().flat_map(|(scope, m)| {
            m.iter()
                .filter_map(move |(id, e)| e.open.as_ref().map(|s| (*scope, id, s)))
        })
    }

    /// How long until the first open session of `scope` times out (at least a second: the
    /// answer is a `Retry-After` in whole seconds); a second when none is open yet.
    fn first_expiry(&self, scope: Scope, now: Instant) -> Duration {
        let timeout = self.cfg.idle_timeout;
        self.scopes
            .get(&scope)
            .into_iter()
            .flat_map(|m| m.values())
            .filter_map(|e| e.open.as_ref())
            .map(|s| timeout.saturating_sub(now.saturating_duration_since(s.last_seen)))
            .min()
            .unwrap_or_default()
            .max(Duration::from_secs(1))
    }

    fn entry_mut(&mut self, scope: Scope, session_id: &str) -> Option<&mut Entry<T>> {
        self.scopes.get_mut(&scope)?.get_mut(session_id)
    }

    fn open_mut(&mut self, scope: Scope, session_id: &str) -> Option<&mut Session<T>> {
        self.entry_mut(scope, session_id)?.open.as_mut()
    }

    /// Removes an entry that is neither open nor held, and a scope left empty.
    fn prune(&mut self, scope: Scope, session_id: &str) {
        let Some(m) = self.scopes.get_mut(&scope) else {
            return;
        };
        if m.get(session_id)
            .is_some_and(|e| e.open.is_none() && e.in_flight == 0)
        {
            m.remove(session_id);
        }
        if m.is_empty() {
            self.scopes.remove(&scope);
        }
    }

    fn end(&mut self, scope: Scope, session_id: &str, why: TurnEnd) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let Some(s) = self
            .entry_mut(scope, session_id)
            .and_then(|e| e.open.take())
        else {
            return out;
        };
        self.prune(scope, session_id);
        match why {
            TurnEnd::IdleTimeout => self.stats.ended_idle += 1,
            _ => self.stats.ended_done += 1,
        }
        if let Some(t) = s.pending {
            self.close(session_id, t, why, &mut out);
        }
        out
    }

    fn close(&mut self, session_id: &str, turn: T, why: TurnEnd, out: &mut Vec<Finished<T>>) {
        match self.cfg.on_end {
            EndPolicy::Keep => {
                self.stats.kept_without_next_state += 1;
                out.push(Finished {
                    session_id: session_id.to_string(),
                    turn,
                    next_state: None,
                    next_messages: Vec::new(),
                    end: why,
                });
            }
            EndPolicy::Drop => self.stats.dropped += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const A: Scope = Scope::key(0);
    const B: Scope = Scope::key(1);

    fn table(on_end: EndPolicy) -> SessionTable<&'static str> {
        SessionTable::new(SessionConfig {
            default_turn_type: TurnType::Main,
            idle_timeout: Duration::from_secs(10),
            on_end,
            max_sessions_per_key: 4,
        })
    }

    /// Serves a main turn of (`scope`, `id`) the way the server does: admitted, then served.
    fn serve(
        t: &mut SessionTable<&'static str>,
        scope: Scope,
        id: &str,
        turn: &'static str,
        done: bool,
        now: Instant,
    ) -> Vec<Finished<&'static str>> {
        let adm = t.admit(scope, id, now).unwrap();
        t.on_served(adm, turn, None, done, now)
    }

    #[test]
    fn next_main_request_gives_the_next_state() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        let user1 = json!({"role": "user", "content": "hi"});
        assert!(t
            .on_request(A, "s", TurnType::Main, Some(&user1), t0)
            .is_empty());
        assert!(serve(&mut t, A, "s", "a1", false, t0).is_empty());
        // A side turn in between neither completes nor replaces the pending turn.
        let side = json!({"role": "user", "content": "summarise"});
        assert!(t
            .on_request(A, "s", TurnType::Side, Some(&side), t0)
            .is_empty());
        assert!(t.on_side_served(A, "s", false, t0).is_empty());
        let tool = json!({"role": "tool", "content": "exit 0"});
        let out = t.on_request(A, "s", TurnType::Main, Some(&tool), t0);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].turn, "a1");
        assert_eq!(out[0].next_state, Some(tool));
        assert_eq!(out[0].end, TurnEnd::NextState);
        let st = t.stats();
        assert_eq!(
            (st.main_turns, st.side_turns, st.with_next_state),
            (1, 1, 1)
        );
    }

    #[test]
    fn session_done_keeps_or_drops_the_last_turn_and_counts_it() {
        let t0 = Instant::now();
        let u = json!({"role": "user", "content": "x"});
        let mut keep = table(EndPolicy::Keep);
        keep.on_request(A, "s", TurnType::Main, Some(&u), t0);
        let out = serve(&mut keep, A, "s", "last", true, t0);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].turn, out[0].next_state.clone()), ("last", None));
        assert_eq!(out[0].end, TurnEnd::SessionDone);
        assert_eq!(keep.stats().kept_without_next_state, 1);
        assert_eq!((keep.open_sessions(), keep.held(A)), (0, 0));

        let mut drop = table(EndPolicy::Drop);
        drop.on_request(A, "s", TurnType::Main, Some(&u), t0);
        assert!(serve(&mut drop, A, "s", "last", true, t0).is_empty());
        assert_eq!((drop.stats().dropped, drop.stats().ended_done), (1, 1));
    }

    #[test]
    fn idle_timeout_ends_only_idle_sessions() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        serve(&mut t, A, "old", "o", false, t0);
        serve(&mut t, A, "new", "n", false, t0 + Duration::from_secs(5));
        assert!(t.expire(t0 + Duration::from_secs(9)).is_empty());
        let out = t.expire(t0 + Duration::from_secs(10));
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].turn, out[0].end), ("o", TurnEnd::IdleTimeout));
        assert_eq!(t.open_sessions(), 1);
        assert_eq!(t.stats().ended_idle, 1);
        // A session that is touched again lives on.
        t.on_request(A, "new", TurnType::Side, None, t0 + Duration::from_secs(14));
        assert!(t.expire(t0 + Duration::from_secs(16)).is_empty());
    }

    #[test]
    fn turn_type_resolution() {
        let t = table(EndPolicy::Keep);
        assert_eq!(t.resolve_turn_type(None, true), TurnType::Main);
        assert_eq!(
            t.resolve_turn_type(Some(TurnType::Side), true),
            TurnType::Side
        );
        let side_default = SessionTable::<()>::new(SessionConfig {
            default_turn_type: TurnType::Side,
            idle_timeout: Duration::from_secs(1),
            on_end: EndPolicy::Keep,
            max_sessions_per_key: 1,
        });
        // A named session without a turn type is main even when the default is side.
        assert_eq!(side_default.resolve_turn_type(None, true), TurnType::Main);
        assert_eq!(side_default.resolve_turn_type(None, false), TurnType::Side);
        assert_eq!("SIDE".parse::<TurnType>(), Ok(TurnType::Side));
        assert!("other".parse::<TurnType>().is_err());
    }

    #[test]
    fn a_non_user_last_message_closes_the_pending_turn_without_next_state() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        serve(&mut t, A, "s", "a", false, t0);
        let asst = json!({"role": "assistant", "content": "..."});
        let out = t.on_request(A, "s", TurnType::Main, Some(&asst), t0);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].next_state.clone(), out[0].end),
            (None, TurnEnd::NoNextState)
        );
    }

    #[test]
    fn the_same_id_under_two_keys_is_two_sessions() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        serve(&mut t, A, "s", "a-turn", false, t0);
        // B's message on the same id completes nothing of A's, and B's done ends nothing of A's.
        let praise = json!({"role": "user", "content": "perfect, thanks!"});
        assert!(t
            .on_request(B, "s", TurnType::Main, Some(&praise), t0)
            .is_empty());
        assert!(t.end_session(B, "s").is_empty());
        assert!(t.on_side_served(B, "s", true, t0).is_empty());
        let out = serve(&mut t, B, "s", "b-turn", true, t0);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].turn, "b-turn");
        // A's turn is still pending, and A's own next message completes it.
        let fix = json!({"role": "user", "content": "shorter"});
        let out = t.on_request(A, "s", TurnType::Main, Some(&fix), t0);
        assert_eq!(
            (out[0].turn, out[0].next_state.clone()),
            ("a-turn", Some(fix))
        );
    }

    #[test]
    fn the_cap_counts_open_and_admitted_sessions_per_key() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        serve(&mut t, A, "s0", "0", false, t0);
        serve(&mut t, A, "s1", "1", false, t0 + Duration::from_secs(3));
        let a2 = t.admit(A, "s2", t0).unwrap();
        let a3 = t.admit(A, "s3", t0).unwrap();
        // Four held: a fifth id is refused, with the time until s0 times out.
        let full = t.admit(A, "s4", t0 + Duration::from_secs(4)).unwrap_err();
        assert_eq!(full.cap, 4);
        assert_eq!(full.retry_after, Duration::from_secs(6));
        assert!(
            full.to_string().contains("max_sessions_per_key = 4"),
            "{full}"
        );
        // Held ids are still admitted (overlapping requests), and another key has its own cap.
        let again = t.admit(A, "s2", t0).unwrap();
        let b = t.admit(B, "s4", t0).unwrap();
        t.release(b);
        // A refused (released) admission opens nothing and frees its place.
        t.release(a3);
        assert_eq!((t.held(A), t.open_sessions()), (3, 2));
        let a4 = t.admit(A, "s4", t0).unwrap();
        t.release(a4);
        // s2 opens when served; its second admission still holds it until released.
        t.on_served(a2, "2", None, false, t0 + Duration::from_secs(5));
        t.release(again);
        assert_eq!((t.held(A), t.open_sessions(), t.held(B)), (3, 3, 0));
        assert_eq!(t.stats().refused_full, 1);
        // An admission whose session timed out meanwhile reopens it when served.
        let late = t.admit(A, "s0", t0).unwrap();
        assert_eq!(t.expire(t0 + Duration::from_secs(10)).len(), 1);
        assert_eq!(t.held(A), 3, "s0 is still held by its request");
        t.on_served(late, "0b", None, false, t0 + Duration::from_secs(10));
        assert_eq!((t.held(A), t.open_sessions()), (3, 3));
        assert_eq!(t.stats().started, 4);
    }

    /// Serves an unnamed main request the way the server does: inferred (else `fresh`),
    /// admitted, linked, served. Returns the session id and the turns to record.
    fn unnamed(
        t: &mut SessionTable<&'static str>,
        scope: Scope,
        request: &[serde_json::Value],
        response: serde_json::Value,
        turn: &'static str,
        fresh: &str,
    ) -> (String, Vec<Finished<&'static str>>) {
        let now = Instant::now();
        let inferred = t.infer(scope, request);
        let id = inferred
            .as_ref()
            .map_or(fresh.to_string(), |i| i.session_id.clone());
        let adm = t.admit(scope, &id, now).unwrap();
        let mut out = match &inferred {
            Some(i) => t.on_inferred(scope, i, now),
            None => Vec::new(),
        };
        let tr = Transcript::new(request, &response);
        out.extend(t.on_served(adm, turn, Some(tr), false, now));
        (id, out)
    }

    fn sys() -> serde_json::Value {
        json!({"role": "system", "content": "You are OpenClaw."})
    }

    fn user(text: &str) -> serde_json::Value {
        json!({"role": "user", "content": text})
    }

    fn said(text: &str) -> serde_json::Value {
        json!({"role": "assistant", "content": text})
    }

    fn internal(n: u32) -> serde_json::Value {
        user(&format!(
            "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nturn {n}\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
        ))
    }

    #[test]
    fn openclaw_drops_its_internal_context_and_stays_in_one_session() {
        let mut t = table(EndPolicy::Keep);
        let r1 = vec![sys(), user("list files"), internal(1)];
        let (s1, out) = unnamed(&mut t, A, &r1, said("a.txt b.txt"), "t1", "fresh1");
        assert!(out.is_empty());
        // The next request drops the first internal-context message and adds its own.
        let r2 = vec![
            sys(),
            user("list files"),
            said("a.txt b.txt"),
            user("now the hidden ones"),
            internal(2),
        ];
        let (s2, out) = unnamed(&mut t, A, &r2, said(".env"), "t2", "fresh2");
        assert_eq!(s2, s1);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].turn, out[0].end), ("t1", TurnEnd::NextState));
        assert_eq!(out[0].next_messages, r2[3..].to_vec());
        assert_eq!(out[0].next_state, Some(internal(2)));
        let r3 = vec![
            sys(),
            user("list files"),
            said("a.txt b.txt"),
            user("now the hidden ones"),
            said(".env"),
            user("thanks"),
            internal(3),
        ];
        let (s3, out) = unnamed(&mut t, A, &r3, said("you're welcome"), "t3", "fresh3");
        assert_eq!(s3, s1);
        assert_eq!((out[0].turn, out[0].next_messages.len()), ("t2", 2));
        let st = t.stats();
        assert_eq!((st.started, st.inferred, st.with_next_state), (1, 2, 2));
        assert_eq!(t.open_sessions(), 1);
    }

    #[test]
    fn tool_results_are_the_next_state_of_a_tool_call_turn() {
        let mut t = table(EndPolicy::Keep);
        let r1 = vec![sys(), user("what is in /tmp and /var?")];
        let served = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "exec", "arguments": "{\"cmd\":\"ls /tmp\"}"}},
            {"id": "call_b", "type": "function",
             "function": {"name": "exec", "arguments": "{\"cmd\":\"ls /var\"}"}}]});
        let (s1, _) = unnamed(&mut t, A, &r1, served, "calls", "f1");
        // The client resends the calls with re-serialised arguments and content parts.
        let resent = json!({"role": "assistant", "content": [], "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "exec", "arguments": "{\"cmd\": \"ls /tmp\"}"}},
            {"id": "call_b", "type": "function",
             "function": {"name": "exec", "arguments": {"cmd": "ls /var"}}}]});
        let tool_a = json!({"role": "tool", "tool_call_id": "call_a",
            "content": [{"type": "text", "text": "x.log"}]});
        let tool_b = json!({"role": "tool", "tool_call_id": "call_b", "content": "cache"});
        let r2 = vec![
            sys(),
            user("what is in /tmp and /var?"),
            resent,
            tool_a,
            tool_b,
        ];
        let (s2, out) = unnamed(&mut t, A, &r2, said("x.log; cache"), "answer", "f2");
        assert_eq!(s2, s1);
        assert_eq!(out[0].turn, "calls");
        assert_eq!(out[0].next_messages, r2[3..].to_vec());
    }

    #[test]
    fn the_sdk_appending_to_a_list_links_every_turn() {
        let mut t = table(EndPolicy::Keep);
        let mut convo = vec![user("1+1?")];
        let (first, _) = unnamed(&mut t, A, &convo, said("2"), "t1", "f1");
        for (i, (q, a)) in [("2+2?", "4"), ("3+3?", "6")].into_iter().enumerate() {
            let prev = if i == 0 { "2" } else { "4" };
            convo.push(said(prev));
            convo.push(user(q));
            let (id, out) = unnamed(&mut t, A, &convo, said(a), "t", "fresh");
            assert_eq!(id, first);
            assert_eq!(out[0].next_messages, vec![user(q)]);
        }
        // A request that extends nothing opens a new session.
        let (other, out) = unnamed(&mut t, A, &[user("hello")], said("hi"), "x", "new");
        assert_eq!((other.as_str(), out.len()), ("new", 0));
        assert_eq!(t.stats().started, 2);
    }

    #[test]
    fn ties_go_to_the_fewest_dropped_messages_then_the_most_recent_turn() {
        let mut t = table(EndPolicy::Keep);
        let q = vec![sys(), user("hi")];
        unnamed(&mut t, A, &q, said("hello"), "old", "s-old");
        unnamed(&mut t, A, &q, said("hello"), "new", "s-new");
        let next = vec![sys(), user("hi"), said("hello"), user("bye")];
        let i = t.infer(A, &next).unwrap();
        assert_eq!(
            i.session_id, "s-new",
            "identical histories: the most recent"
        );
        // A turn whose prompt the request keeps whole beats one it dropped messages of.
        unnamed(
            &mut t,
            A,
            &[sys(), user("hi"), internal(1)],
            said("hello"),
            "newest",
            "s-ctx",
        );
        assert_eq!(t.infer(A, &next).unwrap().session_id, "s-new");
    }

    #[test]
    fn a_regeneration_closes_the_newer_pending_turn() {
        let mut t = table(EndPolicy::Keep);
        let r1 = vec![user("write a poem")];
        let (s, _) = unnamed(&mut t, A, &r1, said("roses"), "t1", "f");
        let r2 = vec![user("write a poem"), said("roses"), user("shorter")];
        unnamed(&mut t, A, &r2, said("rose"), "t2", "g");
        // The user edits their second message: the request extends t1, not t2.
        let edited = vec![user("write a poem"), said("roses"), user("longer")];
        let (id, out) = unnamed(&mut t, A, &edited, said("roses, red"), "t2b", "h");
        assert_eq!(id, s);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].turn, out[0].end, out[0].next_state.clone()),
            ("t2", TurnEnd::Superseded, None)
        );
        assert_eq!(t.stats().superseded, 1);
        // The new branch goes on: its pending turn is the edited one.
        let r3 = vec![
            user("write a poem"),
            said("roses"),
            user("longer"),
            said("roses, red"),
            user("good"),
        ];
        let (id, out) = unnamed(&mut t, A, &r3, said("thanks"), "t3", "i");
        assert_eq!((id.as_str(), out[0].turn), (s.as_str(), "t2b"));
        assert_eq!(out[0].end, TurnEnd::NextState);
    }

    #[test]
    fn another_keys_turns_are_never_matched() {
        let mut t = table(EndPolicy::Keep);
        let r1 = vec![user("secret plan")];
        let (sa, _) = unnamed(&mut t, A, &r1, said("ok"), "a1", "sa");
        let r2 = vec![user("secret plan"), said("ok"), user("go on")];
        assert!(t.infer(B, &r2).is_none());
        let (sb, out) = unnamed(&mut t, B, &r2, said("no"), "b1", "sb");
        assert_ne!(sb, sa);
        assert!(out.is_empty());
        // A's own continuation still links.
        assert_eq!(t.infer(A, &r2).unwrap().session_id, sa);
    }

    /// Random interleavings of admissions, served and released turns, named and header-less
    /// requests, session ends and idle time, against the table's invariants: the cap always
    /// holds, a request extending the turn just served is linked to its session, no turn comes
    /// out twice, and at shutdown every served turn came out exactly once (or was counted as
    /// dropped), with the counters balancing.
    mod interleavings {
        use super::*;
        use proptest::prelude::*;
        use serde_json::Value;
        use std::collections::{HashMap, HashSet};

        #[derive(Debug, Clone)]
        enum Op {
            Admit {
                scope: u8,
                sess: u8,
            },
            Serve {
                i: usize,
                done: bool,
            },
            Release {
                i: usize,
            },
            Named {
                scope: u8,
                sess: u8,
                user: bool,
                side: bool,
            },
            Extend {
                k: usize,
            },
            End {
                scope: u8,
                sess: u8,
            },
            Wait {
                secs: u8,
            },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                3 => (0..2u8, 0..5u8).prop_map(|(scope, sess)| Op::Admit { scope, sess }),
                3 => (any::<usize>(), prop::bool::weighted(0.1))
                    .prop_map(|(i, done)| Op::Serve { i, done }),
                1 => any::<usize>().prop_map(|i| Op::Release { i }),
                2 => (0..2u8, 0..5u8, any::<bool>(), prop::bool::weighted(0.2))
                    .prop_map(|(scope, sess, user, side)| Op::Named { scope, sess, user, side }),
                2 => any::<usize>().prop_map(|k| Op::Extend { k }),
                1 => (0..2u8, 0..5u8).prop_map(|(scope, sess)| Op::End { scope, sess }),
                1 => (0..15u8).prop_map(|secs| Op::Wait { secs }),
            ]
        }

        /// A served turn: where, what was sent, what was answered.
        struct Served {
            scope: Scope,
            sess: String,
            sent: Vec<Value>,
            response: Value,
        }

        fn user(text: String) -> Value {
            json!({"role": "user", "content": text})
        }

        fn extension(t: &Served, k: usize) -> Vec<Value> {
            let mut m = t.sent.clone();
            m.push(t.response.clone());
            m.push(user(format!("next {k}")));
            m
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
            #[test]
            fn the_rules_hold_under_any_interleaving(
                ops in prop::collection::vec(op(), 1..120),
                keep in any::<bool>(),
            ) {
                let cap = 3;
                let mut t: SessionTable<usize> = SessionTable::new(SessionConfig {
                    default_turn_type: TurnType::Main,
                    idle_timeout: Duration::from_secs(10),
                    on_end: if keep { EndPolicy::Keep } else { EndPolicy::Drop },
                    max_sessions_per_key: cap,
                });
                let start = Instant::now();
                let mut now = start;
                let mut in_flight: Vec<Admission> = Vec::new();
                let mut served: Vec<Served> = Vec::new();
                let mut history: HashMap<(Scope, String), Vec<Value>> = HashMap::new();
                let mut out: Vec<Finished<usize>> = Vec::new();
                let mut seen = HashSet::new();
                for op in ops {
                    let got = match op {
                        Op::Admit { scope, sess } => {
                            if let Ok(a) = t.admit(Scope::key(scope.into()), &format!("s{sess}"), now) {
                                in_flight.push(a);
                            }
                            Vec::new()
                        }
                        Op::Serve { i, done } if !in_flight.is_empty() => {
                            let a = in_flight.remove(i % in_flight.len());
                            let key = (a.scope(), a.session_id().to_string());
                            let id = served.len();
                            let mut sent = history.get(&key).cloned().unwrap_or_default();
                            sent.push(user(format!("turn {id}")));
                            let response = json!({"role": "assistant", "content": format!("answer {id}")});
                            let transcript = Transcript::new(&sent, &response);
                            let got = t.on_served(a, id, Some(transcript), done, now);
                            let mut h = sent.clone();
                            h.push(response.clone());
                            history.insert(key.clone(), h);
                            served.push(Served { scope: key.0, sess: key.1, sent, response });
                            if !done {
                                // A request extending the turn just served continues its session.
                                let inf = t.infer(key.0, &extension(&served[id], id));
                                prop_assert_eq!(inf.map(|i| i.session_id), Some(served[id].sess.clone()));
                            }
                            got
                        }
                        Op::Release { i } if !in_flight.is_empty() => {
                            let a = in_flight.remove(i % in_flight.len());
                            t.release(a);
                            Vec::new()
                        }
                        Op::Named { scope, sess, user: u, side } => {
                            let last = if u {
                                user("named".into())
                            } else {
                                json!({"role": "assistant", "content": "prefill"})
                            };
                            let kind = if side { TurnType::Side } else { TurnType::Main };
                            t.on_request(Scope::key(scope.into()), &format!("s{sess}"), kind, Some(&last), now)
                        }
                        Op::Extend { k } if !served.is_empty() => {
                            let k = k % served.len();
                            let s = &served[k];
                            match t.infer(s.scope, &extension(s, k)) {
                                Some(inf) => {
                                    // Responses are unique, so only its own session can match.
                                    prop_assert_eq!(&inf.session_id, &s.sess);
                                    let a = t.admit(s.scope, &inf.session_id, now);
                                    prop_assert!(a.is_ok(), "an open session is always admitted");
                                    let got = t.on_inferred(s.scope, &inf, now);
                                    t.release(a.unwrap());
                                    got
                                }
                                None => Vec::new(),
                            }
                        }
                        Op::End { scope, sess } => t.end_session(Scope::key(scope.into()), &format!("s{sess}")),
                        Op::Wait { secs } => {
                            now += Duration::from_secs(secs.into());
                            t.expire(now)
                        }
                        _ => Vec::new(),
                    };
                    for f in got {
                        prop_assert!(f.turn < served.len(), "only served turns come out");
                        prop_assert!(seen.insert(f.turn), "turn {} came out twice", f.turn);
                        out.push(f);
                    }
                    for scope in 0..2 {
                        prop_assert!(t.held(Scope::key(scope)) <= cap, "the cap holds");
                    }
                }
                for a in in_flight.drain(..) {
                    t.release(a);
                }
                for f in t.end_all() {
                    prop_assert!(seen.insert(f.turn), "turn {} came out twice", f.turn);
                    out.push(f);
                }
                let st = t.stats();
                prop_assert_eq!(out.len() as u64 + st.dropped, served.len() as u64, "nothing lost");
                prop_assert_eq!(st.main_turns, served.len() as u64);
                prop_assert_eq!(
                    st.with_next_state,
                    out.iter().filter(|f| f.end == TurnEnd::NextState).count() as u64
                );
                prop_assert_eq!(st.started, st.ended_done + st.ended_idle, "every session ended");
                prop_assert_eq!(t.open_sessions(), 0);
                prop_assert_eq!(t.held(Scope::key(0)) + t.held(Scope::key(1)), 0);
            }
        }
    }
}

//! The session table: which turns become training records, and with which next state. Pure and
//! clock-free (`now` is an argument, DESIGN §6); the server calls it under a lock and sends what
//! it returns to the record sink.
//!
//! Rules (DESIGN §4, issue 7):
//! - a request names its session (`X-Session-Id` / `session_id`); one without gets a fresh id;
//! - its turn type is `main` or `side` (`X-Turn-Type` / `turn_type`); when absent, a request
//!   that names a session is `main`, and one that does not takes the configured default
//!   (`main` unless configured otherwise);
//! - side turns are served and counted, never recorded;
//! - a main turn waits as the session's *pending* turn; on the next main request its last
//!   message becomes the pending turn's next state (if it is a `user` or `tool` message;
//!   otherwise the pending turn is closed as if the session ended);
//! - a session ends on `X-Session-Done` or after the idle timeout; its pending turn is then
//!   recorded without a next state or dropped ([`EndPolicy`]), and counted either way.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
}

/// Counters of the table, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
}

/// A turn handed back for recording; `T` is the server's turn data.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished<T> {
    /// The session.
    pub session_id: String,
    /// The turn.
    pub turn: T,
    /// The next state (the next main request's last message), if any.
    pub next_state: Option<serde_json::Value>,
    /// Why it left the table.
    pub end: TurnEnd,
}

struct Session<T> {
    last_seen: Instant,
    pending: Option<T>,
}

/// The table of open sessions.
pub struct SessionTable<T> {
    cfg: SessionConfig,
    sessions: HashMap<String, Session<T>>,
    stats: SessionStats,
}

impl<T> SessionTable<T> {
    /// An empty table.
    pub fn new(cfg: SessionConfig) -> Self {
        Self {
            cfg,
            sessions: HashMap::new(),
            stats: SessionStats::default(),
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

    /// Open sessions.
    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// The turn type of a request: explicit wins; a named session means main; else the default.
    pub fn resolve_turn_type(&self, explicit: Option<TurnType>, named_session: bool) -> TurnType {
        match explicit {
            Some(t) => t,
            None if named_session => TurnType::Main,
            None => self.cfg.default_turn_type,
        }
    }

    /// A request of `session_id` arrives. For a main request, `last_message` (the request's last
    /// message) completes the session's pending turn. Returns turns to record.
    pub fn on_request(
        &mut self,
        session_id: &str,
        turn_type: TurnType,
        last_message: Option<&serde_json::Value>,
        now: Instant,
    ) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let s = self.touch(session_id, now);
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
                end: TurnEnd::NextState,
            });
        } else {
            self.close(session_id, turn, TurnEnd::NoNextState, &mut out);
        }
        out
    }

    /// A turn of `session_id` was served. A main turn becomes the pending turn (a still pending
    /// older one, from overlapping requests, is closed without a next state); a side turn is
    /// only counted. With `done`, the session ends now. Returns turns to record.
    pub fn on_served(
        &mut self,
        session_id: &str,
        turn_type: TurnType,
        turn: T,
        done: bool,
        now: Instant,
    ) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let s = self.touch(session_id, now);
        let older = match turn_type {
            TurnType::Main => s.pending.replace(turn),
            TurnType::Side => None,
        };
        match turn_type {
            TurnType::Main => self.stats.main_turns += 1,
            TurnType::Side => self.stats.side_turns += 1,
        }
        if let Some(t) = older {
            self.close(session_id, t, TurnEnd::NoNextState, &mut out);
        }
        if done {
            out.extend(self.end(session_id, TurnEnd::SessionDone));
        }
        out
    }

    /// Ends `session_id` now (`X-Session-Done` on a request that was not served, e.g. one that
    /// failed). Returns its pending turn if it is kept.
    pub fn end_session(&mut self, session_id: &str) -> Vec<Finished<T>> {
        self.end(session_id, TurnEnd::SessionDone)
    }

    /// Ends every session idle for at least the timeout at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Finished<T>> {
        let timeout = self.cfg.idle_timeout;
        let idle: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_seen) >= timeout)
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for id in idle {
            out.extend(self.end(&id, TurnEnd::IdleTimeout));
        }
        out
    }

    /// Ends every session (server shutdown), as an idle timeout would.
    pub fn end_all(&mut self) -> Vec<Finished<T>> {
        let ids: Vec<String> = self.sessions.keys().cloned().collect();
        let mut out = Vec::new();
        for id in ids {
            out.extend(self.end(&id, TurnEnd::IdleTimeout));
        }
        out
    }

    fn touch(&mut self, session_id: &str, now: Instant) -> &mut Session<T> {
        if !self.sessions.contains_key(session_id) {
            self.stats.started += 1;
        }
        let s = self
            .sessions
            .entry(session_id.to_string())
            .or_insert(Session {
                last_seen: now,
                pending: None,
            });
        s.last_seen = s.last_seen.max(now);
        s
    }

    fn end(&mut self, session_id: &str, why: TurnEnd) -> Vec<Finished<T>> {
        let mut out = Vec::new();
        let Some(s) = self.sessions.remove(session_id) else {
            return out;
        };
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

    fn table(on_end: EndPolicy) -> SessionTable<&'static str> {
        SessionTable::new(SessionConfig {
            default_turn_type: TurnType::Main,
            idle_timeout: Duration::from_secs(10),
            on_end,
        })
    }

    #[test]
    fn next_main_request_gives_the_next_state() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        let user1 = json!({"role": "user", "content": "hi"});
        assert!(t
            .on_request("s", TurnType::Main, Some(&user1), t0)
            .is_empty());
        assert!(t.on_served("s", TurnType::Main, "a1", false, t0).is_empty());
        // A side turn in between neither completes nor replaces the pending turn.
        let side = json!({"role": "user", "content": "summarise"});
        assert!(t
            .on_request("s", TurnType::Side, Some(&side), t0)
            .is_empty());
        assert!(t
            .on_served("s", TurnType::Side, "side", false, t0)
            .is_empty());
        let tool = json!({"role": "tool", "content": "exit 0"});
        let out = t.on_request("s", TurnType::Main, Some(&tool), t0);
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
        keep.on_request("s", TurnType::Main, Some(&u), t0);
        let out = keep.on_served("s", TurnType::Main, "last", true, t0);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].turn, out[0].next_state.clone()), ("last", None));
        assert_eq!(out[0].end, TurnEnd::SessionDone);
        assert_eq!(keep.stats().kept_without_next_state, 1);
        assert_eq!(keep.open_sessions(), 0);

        let mut drop = table(EndPolicy::Drop);
        drop.on_request("s", TurnType::Main, Some(&u), t0);
        assert!(drop
            .on_served("s", TurnType::Main, "last", true, t0)
            .is_empty());
        assert_eq!((drop.stats().dropped, drop.stats().ended_done), (1, 1));
    }

    #[test]
    fn idle_timeout_ends_only_idle_sessions() {
        let mut t = table(EndPolicy::Keep);
        let t0 = Instant::now();
        t.on_served("old", TurnType::Main, "o", false, t0);
        t.on_served(
            "new",
            TurnType::Main,
            "n",
            false,
            t0 + Duration::from_secs(5),
        );
        assert!(t.expire(t0 + Duration::from_secs(9)).is_empty());
        let out = t.expire(t0 + Duration::from_secs(10));
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].turn, out[0].end), ("o", TurnEnd::IdleTimeout));
        assert_eq!(t.open_sessions(), 1);
        assert_eq!(t.stats().ended_idle, 1);
        // A session that is touched again lives on.
        t.on_request("new", TurnType::Side, None, t0 + Duration::from_secs(14));
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
        t.on_served("s", TurnType::Main, "a", false, t0);
        let asst = json!({"role": "assistant", "content": "..."});
        let out = t.on_request("s", TurnType::Main, Some(&asst), t0);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].next_state.clone(), out[0].end),
            (None, TurnEnd::NoNextState)
        );
    }
}

//! The experiment's process reward model: a rule-based step judge over each tool step.
//!
//! **What it sees:** the task (it recomputes the task's intermediate quantity and answer from
//! the generated task, i.e. it knows a reference solution), the tool messages the step produced
//! (exactly the text the policy reads: `exit code`, `stdout`, `stderr`, or the environment's
//! error text), and the quantities earlier steps of the same episode already printed.
//!
//! **What it scores:** `+1` when every call of the step ran (exit code 0, not timed out, not
//! refused by the environment) and the last number printed by at least one of them is the
//! task's intermediate quantity or its answer, not printed by an earlier step; `-1` otherwise
//! (an error, a refused call, nothing useful printed, a wrong value, or a repeat). A step with
//! no next state (the final answer) is not judged: it gets no vote, so its process score is 0
//! (docs/design.md §1). One deterministic vote per step (`m = 1`).
//!
//! In the RL job the PRM answers the job's judge over HTTP ([`super::endpoint`]), which sends
//! it the step's tool messages and the episode's messages before the step;
//! [`judge_transcript`] replays the earlier steps to know what was already printed.

use clawrl::env::answer::{extract_answer, numbers_match, parse_number, Number};

use super::tasks::GenTask;

/// What the PRM found in one tool message.
#[derive(Debug, Clone, PartialEq)]
pub struct CallReading {
    /// The call ran to exit code 0.
    pub ran: bool,
    /// The last number its stdout printed.
    pub printed: Option<Number>,
}

/// Reads a tool message's text as the environment renders it
/// ([`clawrl::env::exec::render_output`]).
pub fn read_call(text: &str) -> CallReading {
    let ran = text.starts_with("exit code: 0\n");
    let printed = if ran {
        text.find("stdout:\n").and_then(|start| {
            let body = &text[start + "stdout:\n".len()..];
            let end = body.rfind("stderr:\n").unwrap_or(body.len());
            extract_answer(&body[..end])
                .as_deref()
                .and_then(parse_number)
        })
    } else {
        None
    };
    CallReading { ran, printed }
}

/// The vote for one tool step whose next state holds the tool messages `results`; `seen` holds
/// the useful quantities earlier steps of the episode printed and is extended with this
/// step's.
pub fn judge_step(task: &GenTask, results: &[String], seen: &mut Vec<i64>) -> i8 {
    if results.is_empty() {
        return -1;
    }
    let useful = [task.intermediate(), task.answer()];
    let readings: Vec<CallReading> = results.iter().map(|r| read_call(r)).collect();
    if !readings.iter().all(|r| r.ran) {
        return -1;
    }
    let mut fresh = false;
    for r in &readings {
        let Some(n) = r.printed else { continue };
        if let Some(&u) = useful.iter().find(|&&u| {
            numbers_match(
                n,
                Number::Exact {
                    num: u as i128,
                    den: 1,
                },
            )
        }) {
            if !seen.contains(&u) {
                seen.push(u);
                fresh = true;
            }
        }
    }
    if fresh {
        1
    } else {
        -1
    }
}

/// The vote for a step whose tool messages are `results`, with `messages` the episode's messages
/// before it (`(role, text)`): every earlier step (an assistant message and the tool messages
/// that follow it) is judged first, in order, so that a value an earlier step printed counts as
/// a repeat exactly as in [`judge_step`] over the whole episode.
pub fn judge_transcript(task: &GenTask, messages: &[(&str, &str)], results: &[String]) -> i8 {
    let mut seen = Vec::new();
    let mut step: Vec<String> = Vec::new();
    for (role, text) in messages {
        match *role {
            "tool" => step.push(text.to_string()),
            _ => {
                if !step.is_empty() {
                    judge_step(task, &step, &mut seen);
                    step.clear();
                }
            }
        }
    }
    if !step.is_empty() {
        judge_step(task, &step, &mut seen);
    }
    judge_step(task, results, &mut seen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiments::toolagent::tasks::Op;
    use clawrl::env::exec::render_output;
    use clawrl::sandbox::ExecOutput;
    use std::time::Duration;

    fn out(stdout: &str, stderr: &str, code: Option<i32>, timed_out: bool) -> String {
        render_output(
            &ExecOutput {
                stdout: stdout.into(),
                stderr: stderr.into(),
                exit_code: code,
                signal: if code.is_none() { Some(9) } else { None },
                timed_out,
                truncated: false,
                wall: Duration::from_millis(20),
            },
            4096,
        )
        .0
    }

    fn task() -> GenTask {
        // 47 + 29*18: intermediate 522, answer 569.
        GenTask {
            operands: [47, 29, 18],
            ops: [Op::Add, Op::Mul],
        }
    }

    #[test]
    fn reads_what_the_environment_renders() {
        let r = read_call(&out("522\n", "", Some(0), false));
        assert!(r.ran);
        assert_eq!(r.printed, parse_number("522"));
        let r = read_call(&out("", "Traceback ... NameError\n", Some(1), false));
        assert_eq!(
            r,
            CallReading {
                ran: false,
                printed: None
            }
        );
        let r = read_call(&out("x 1\ny 2\n", "warn 3\n", Some(0), false));
        assert_eq!(r.printed, parse_number("2"));
        assert!(!read_call(&out("", "", None, true)).ran);
        assert!(!read_call("error: unknown tool `calc`; the only tool is `code_interpreter`").ran);
    }

    #[test]
    fn useful_fresh_values_score_plus_one_and_everything_else_minus_one() {
        let t = task();
        let mut seen = vec![];
        assert_eq!(
            judge_step(&t, &[out("522\n", "", Some(0), false)], &mut seen),
            1
        );
        // The same value again is a repeat.
        assert_eq!(
            judge_step(&t, &[out("522\n", "", Some(0), false)], &mut seen),
            -1
        );
        assert_eq!(
            judge_step(&t, &[out("569\n", "", Some(0), false)], &mut seen),
            1
        );
        assert_eq!(seen, vec![522, 569]);
        let mut seen = vec![];
        // A wrong value, an error, nothing printed, a refused call, no message at all.
        assert_eq!(
            judge_step(&t, &[out("570\n", "", Some(0), false)], &mut seen),
            -1
        );
        assert_eq!(
            judge_step(&t, &[out("569\n", "boom", Some(1), false)], &mut seen),
            -1
        );
        assert_eq!(
            judge_step(&t, &[out("", "", Some(0), false)], &mut seen),
            -1
        );
        assert_eq!(
            judge_step(
                &t,
                &["not run: the budget of 3 tool calls is used up".into()],
                &mut seen
            ),
            -1
        );
        assert_eq!(judge_step(&t, &[], &mut seen), -1);
        // Two calls in one step: both must run; one useful value suffices.
        assert_eq!(
            judge_step(
                &t,
                &[
                    out("7\n", "", Some(0), false),
                    out("569\n", "", Some(0), false)
                ],
                &mut seen
            ),
            1
        );
        let mut seen = vec![];
        assert_eq!(
            judge_step(
                &t,
                &[
                    out("522\n", "", Some(0), false),
                    out("", "err", Some(1), false)
                ],
                &mut seen
            ),
            -1
        );
        // Equal values in another written form count.
        assert_eq!(
            judge_step(&t, &[out("569.0\n", "", Some(0), false)], &mut seen),
            1
        );
    }

    #[test]
    fn a_transcript_replays_earlier_steps_before_judging_the_last() {
        let t = task();
        let printed = out("522\n", "", Some(0), false);
        let failed = out("522\n", "x", Some(1), false);
        fn before<'a>(tools: &[&'a str]) -> Vec<(&'a str, &'a str)> {
            let mut m = vec![("system", "solve"), ("user", "what is 47+29*18 ?")];
            for tool in tools {
                m.push(("assistant", "<tool_call>…</tool_call>"));
                m.push(("tool", *tool));
            }
            m
        }
        // 522 printed by an earlier step: a repeat.
        assert_eq!(
            judge_transcript(&t, &before(&[&printed]), std::slice::from_ref(&printed)),
            -1
        );
        // The earlier step failed, so its 522 was never taken: fresh now.
        assert_eq!(
            judge_transcript(&t, &before(&[&failed]), std::slice::from_ref(&printed)),
            1
        );
        assert_eq!(
            judge_transcript(&t, &before(&[]), std::slice::from_ref(&printed)),
            1
        );
        assert_eq!(judge_transcript(&t, &before(&[&printed]), &[]), -1);
    }
}

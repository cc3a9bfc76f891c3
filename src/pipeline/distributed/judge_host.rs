//! The judge host: on a `judge` node, it builds each job's judge from the job's spec, under
//! this node's own `[judge]` grants (the endpoints and key variables it allows), and judges the
//! turns the job's home sends it. A judge's endpoint keys thus live on the nodes that judge.
//!
//! Only the job's home (its trainer node, as Control places it) may have its judge built or
//! its turns judged ([`clawrl_actors::authority`]); other callers are refused, and the refusal
//! is logged.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clawrl_actors::authority::{JobPlaces, Need};
use clawrl_actors::config::JudgeAccess;
use clawrl_actors::loops::{Turn, TurnJudge};
use clawrl_actors::rpc;
use clawrl_actors::rpc::Rpc;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::wire::{JudgeReply, JudgeRequest};
use super::{json, unjson, JUDGE_GROUP};
use crate::job::JobSpec;
use crate::pipeline::build_job_judge;

/// How long a job's judge is kept without a turn to judge.
const JUDGE_IDLE: Duration = Duration::from_secs(1800);

/// The actor that judges the turns of jobs on a `judge` node (see the module docs).
pub struct JudgeHost;

/// How a [`JudgeHost`] starts.
pub struct JudgeHostArgs {
    /// What this node's `[judge]` grants a job's judge.
    pub access: JudgeAccess,
    /// This node's name.
    pub node: String,
}

/// A built judge, with the spec text it was built from and when it last judged.
struct Built {
    spec: String,
    judge: Arc<dyn TurnJudge>,
    used: Instant,
}

/// A [`JudgeHost`]'s state.
pub struct JudgeHostState {
    access: JudgeAccess,
    /// Built judges by job id.
    judges: HashMap<String, Built>,
    /// Where jobs run, to check callers.
    places: JobPlaces,
}

impl JudgeHostState {
    /// The job's judge, built on first use from its spec, and built again should a request
    /// bring other spec text for the job. A judge unused for [`JUDGE_IDLE`] is let go of at the
    /// next request (its job is over, or judges elsewhere): a `model` judge holds a whole model.
    fn judge(
        &mut self,
        job: &str,
        file: &str,
        spec_text: &str,
    ) -> Result<Arc<dyn TurnJudge>, String> {
        let now = Instant::now();
        self.judges
            .retain(|_, b| now.duration_since(b.used) < JUDGE_IDLE);
        if let Some(b) = self.judges.get_mut(job) {
            if b.spec == spec_text {
                b.used = now;
                return Ok(b.judge.clone());
            }
        }
        let spec = JobSpec::parse(spec_text, file).map_err(|e| e.to_string())?;
        // This node's grants, not the home's: the judge sends from here.
        crate::judge::access::check(&spec.judge, &self.access).map_err(|e| e.to_string())?;
        let judge: Arc<dyn TurnJudge> =
            Arc::new(build_job_judge(&spec, file).map_err(|e| e.to_string())?);
        tracing::info!(job = %job, "built the job's judge ({:?} backend)", spec.judge.backend);
        self.judges.insert(
            job.to_string(),
            Built {
                spec: spec_text.to_string(),
                judge: judge.clone(),
                used: now,
            },
        );
        Ok(judge)
    }
}

impl Actor for JudgeHost {
    type Msg = Rpc;
    type State = JudgeHostState;
    type Arguments = JudgeHostArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        args: JudgeHostArgs,
    ) -> Result<JudgeHostState, ActorProcessingErr> {
        ractor::pg::join(JUDGE_GROUP.to_string(), vec![myself.get_cell()]);
        Ok(JudgeHostState {
            access: args.access,
            judges: HashMap::new(),
            places: JobPlaces::new(args.node),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        state: &mut JudgeHostState,
    ) -> Result<(), ActorProcessingErr> {
        let req = match rpc::decode::<JudgeRequest>(&msg.request) {
            Ok(r) => r,
            Err(e) => {
                rpc::reply(
                    msg.reply,
                    &JudgeReply::Failed(format!("malformed judge request: {e}")),
                );
                return Ok(());
            }
        };
        let (JudgeRequest::Prepare { job, .. } | JudgeRequest::Judge { job, .. }) = &req;
        if let Err(e) = state.places.check(job, &msg.caller, Need::Home).await {
            tracing::warn!(caller = %msg.caller, "judge host: request refused: {e}");
            rpc::reply(msg.reply, &JudgeReply::Failed(e.to_string()));
            return Ok(());
        }
        match req {
            JudgeRequest::Prepare { job, file, spec } => {
                let reply = match state.judge(&job, &file, &spec) {
                    Ok(_) => JudgeReply::Ready,
                    Err(e) => JudgeReply::Failed(e),
                };
                rpc::reply(msg.reply, &reply);
            }
            JudgeRequest::Judge {
                job,
                file,
                spec,
                turn,
            } => {
                let judge = match state.judge(&job, &file, &spec) {
                    Ok(j) => j,
                    Err(e) => {
                        rpc::reply(msg.reply, &JudgeReply::Failed(e));
                        return Ok(());
                    }
                };
                // Votes take as long as the judge's endpoint or model: the host goes on
                // taking requests meanwhile.
                tokio::spawn(async move {
                    let reply = match unjson::<Turn>("turn", &turn) {
                        Err(e) => JudgeReply::Failed(e),
                        Ok(turn) => match judge.judge(&turn).await {
                            Ok(j) => JudgeReply::Judged(json(&j)),
                            Err(e) => JudgeReply::Failed(e),
                        },
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = r#"
kind = "rl"
name = "judged"
[policy]
checkpoint = "tests/fixtures/qwen3-tiny"
[judge]
backend = "scripted"
votes = 1
[method]
kind = "binary"
[optim]
batch_size = 4
lr = 1e-6
clip = 0.2
kl = 0.0
staleness = 2
[env]
kind = "scripted"
parallelism = 1
tasks = "tasks.jsonl"
[stop]
max_steps = 1
"#;

    fn state(access: JudgeAccess) -> JudgeHostState {
        JudgeHostState {
            access,
            judges: HashMap::new(),
            places: JobPlaces::new("j1"),
        }
    }

    #[test]
    fn a_jobs_judge_is_built_once_per_spec_text_and_let_go_of_when_idle() {
        let mut s = state(JudgeAccess::default());
        let a = s.judge("job-1", "job.toml", SPEC).unwrap();
        let again = s.judge("job-1", "job.toml", SPEC).unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        // Other spec text for the job: built anew.
        let other = SPEC.replace("votes = 1", "votes = 3");
        let b = s.judge("job-1", "job.toml", &other).unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        // A judge idle past the limit is dropped at the next request, whatever its job.
        s.judges.get_mut("job-1").unwrap().used -= JUDGE_IDLE;
        s.judge("job-2", "job.toml", SPEC).unwrap();
        assert!(!s.judges.contains_key("job-1"));
        assert!(s.judges.contains_key("job-2"));
    }

    #[test]
    fn this_nodes_grants_refuse_a_judge_naming_the_key() {
        let mut s = state(JudgeAccess::default());
        let spec = SPEC.replace(
            r#"backend = "scripted""#,
            "backend = \"openai\"\nendpoint = \"http://192.0.2.1:9/v1\"\nmodel = \"m\"",
        );
        let e = s.judge("job-1", "job.toml", &spec).err().unwrap();
        assert!(e.contains("judge.endpoint `http://192.0.2.1:9/v1`"), "{e}");
        assert!(s.judges.is_empty());
    }
}

//! The environment host: on a node started with `--env KIND:N`, it builds a job's environment
//! from its spec and holds the episodes the job home drives over the wire.
//!
//! Only the job's home (its trainer node, as Control places it) may have the job's environment
//! built and start its episodes, and only on a host whose node Control placed the job on
//! ([`clawrl_actors::authority`]); an episode is stepped and closed only by the node that
//! started it. Other callers are refused, and the refusal is
//! logged.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use clawrl_actors::authority::{JobPlaces, Need, Refusal};
use clawrl_actors::loops::{Environment, Episode};
use clawrl_actors::rpc;
use clawrl_actors::rpc::Rpc;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::wire::{EnvReply, EnvRequest};
use super::{envhost_group, json, lock, unjson, EPISODE_IDLE};
use crate::env::EnvKind;
use crate::job::JobSpec;
use crate::pipeline::build_env_in;

struct OpenEpisode {
    /// The node that started it: the only one that may step or close it.
    owner: String,
    episode: tokio::sync::Mutex<Option<Box<dyn Episode>>>,
    last_used: Mutex<Instant>,
}

type Episodes = Arc<Mutex<HashMap<u64, Arc<OpenEpisode>>>>;

/// The actor that hosts the episodes of jobs on an environment node (see the module docs).
pub struct EnvHost;

/// How an [`EnvHost`] starts.
pub struct EnvHostArgs {
    /// The environment kind it hosts (`--env KIND:N`).
    pub kind: EnvKind,
    /// Where its environments create their work dirs (`<data_dir>/env`).
    pub work_root: PathBuf,
    /// This node's name.
    pub node: String,
}

/// An [`EnvHost`]'s state.
pub struct EnvHostState {
    kind: EnvKind,
    work_root: PathBuf,
    /// Built environments by job id, with the spec text they were built from.
    envs: HashMap<String, (String, Arc<dyn Environment>)>,
    episodes: Episodes,
    next: u64,
    /// Where jobs run, to check callers.
    places: JobPlaces,
}

impl EnvHostState {
    /// The job's environment, built on first use from its spec.
    fn environment(
        &mut self,
        job: &str,
        file: &str,
        spec_text: &str,
    ) -> Result<Arc<dyn Environment>, String> {
        if let Some((text, env)) = self.envs.get(job) {
            if text == spec_text {
                return Ok(env.clone());
            }
        }
        let spec = JobSpec::parse(spec_text, file).map_err(|e| e.to_string())?;
        if spec.env.kind != self.kind {
            return Err(format!(
                "job {job} wants env.kind `{}`; this host runs `{}`",
                spec.env.kind, self.kind
            ));
        }
        let env = build_env_in(&spec, Some(&self.work_root)).map_err(|e| e.to_string())?;
        tracing::info!(
            job = %job,
            "built the job's `{}` environment: {} tasks",
            self.kind,
            env.task_count()
        );
        self.envs
            .insert(job.to_string(), (spec_text.to_string(), env.clone()));
        Ok(env)
    }
}

impl Actor for EnvHost {
    type Msg = Rpc;
    type State = EnvHostState;
    type Arguments = EnvHostArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Rpc>,
        args: EnvHostArgs,
    ) -> Result<EnvHostState, ActorProcessingErr> {
        ractor::pg::join(envhost_group(args.kind.name()), vec![myself.get_cell()]);
        let episodes: Episodes = Arc::new(Mutex::new(HashMap::new()));
        // Episodes nobody steps any more (their job's home died) are closed after a while.
        let weak: Weak<Mutex<HashMap<u64, Arc<OpenEpisode>>>> = Arc::downgrade(&episodes);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(60)).await;
                let Some(map) = weak.upgrade() else { return };
                let idle: Vec<Arc<OpenEpisode>> = {
                    let mut m = lock(&map);
                    let ids: Vec<u64> = m
                        .iter()
                        .filter(|(_, e)| lock(&e.last_used).elapsed() > EPISODE_IDLE)
                        .map(|(k, _)| *k)
                        .collect();
                    ids.iter().filter_map(|k| m.remove(k)).collect()
                };
                for e in idle {
                    if let Some(ep) = e.episode.lock().await.take() {
                        tracing::warn!("closing an episode idle for {EPISODE_IDLE:?}");
                        ep.close().await;
                    }
                }
            }
        });
        Ok(EnvHostState {
            kind: args.kind,
            work_root: args.work_root,
            envs: HashMap::new(),
            episodes,
            next: 1,
            places: JobPlaces::new(args.node),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Rpc>,
        msg: Rpc,
        state: &mut EnvHostState,
    ) -> Result<(), ActorProcessingErr> {
        let req = match rpc::decode::<EnvRequest>(&msg.request) {
            Ok(r) => r,
            Err(e) => {
                rpc::reply(
                    msg.reply,
                    &EnvReply::Failed(format!("malformed environment request: {e}")),
                );
                return Ok(());
            }
        };
        let caller = msg.caller.node(state.places.here()).to_string();
        let checked = match &req {
            EnvRequest::Describe { job, .. } | EnvRequest::Start { job, .. } => {
                state
                    .places
                    .check_on_host(job, &msg.caller, Need::Home)
                    .await
            }
            EnvRequest::Step { episode, .. } | EnvRequest::Close { episode } => {
                let owner = lock(&state.episodes)
                    .get(episode)
                    .map(|open| open.owner.clone());
                match owner {
                    Some(owner) if owner != caller => Err(Refusal::NotYourEpisode {
                        episode: *episode,
                        caller: caller.clone(),
                    }),
                    _ => Ok(()),
                }
            }
        };
        if let Err(e) = checked {
            tracing::warn!(caller = %msg.caller, "environment host: request refused: {e}");
            rpc::reply(msg.reply, &EnvReply::Failed(e.to_string()));
            return Ok(());
        }
        match req {
            EnvRequest::Describe { job, file, spec } => {
                let reply = match state.environment(&job, &file, &spec) {
                    Ok(env) => EnvReply::Described {
                        kind: env.kind().to_string(),
                        task_count: env.task_count() as u64,
                        max_steps: env.max_steps(),
                    },
                    Err(e) => EnvReply::Failed(e),
                };
                rpc::reply(msg.reply, &reply);
            }
            EnvRequest::Start {
                job,
                file,
                spec,
                task_index,
                seed,
            } => {
                let env = match state.environment(&job, &file, &spec) {
                    Ok(env) => env,
                    Err(e) => {
                        rpc::reply(msg.reply, &EnvReply::Failed(e));
                        return Ok(());
                    }
                };
                let id = state.next;
                state.next += 1;
                let episodes = state.episodes.clone();
                tokio::spawn(async move {
                    let reply = match env.start(task_index as usize, seed).await {
                        Ok(ep) => {
                            // Who runs what here: one line per episode, with its starter.
                            tracing::info!(job = %job, episode = id, %caller, "episode started");
                            let reply = EnvReply::Started {
                                episode: id,
                                task_id: ep.task_id().to_string(),
                                instruction: ep.instruction().to_string(),
                                observation: json(&ep.observation()),
                            };
                            lock(&episodes).insert(
                                id,
                                Arc::new(OpenEpisode {
                                    owner: caller,
                                    episode: tokio::sync::Mutex::new(Some(ep)),
                                    last_used: Mutex::new(Instant::now()),
                                }),
                            );
                            reply
                        }
                        Err(e) => EnvReply::Failed(e.to_string()),
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            EnvRequest::Step { episode, action } => {
                let open = lock(&state.episodes).get(&episode).cloned();
                tokio::spawn(async move {
                    let reply = match open {
                        None => EnvReply::Failed(format!("no open episode {episode} here")),
                        Some(open) => {
                            *lock(&open.last_used) = Instant::now();
                            let mut guard = open.episode.lock().await;
                            match (
                                guard.as_mut(),
                                unjson::<clawrl_actors::loops::Action>("action", &action),
                            ) {
                                (None, _) => EnvReply::Failed(format!("episode {episode} closed")),
                                (_, Err(e)) => EnvReply::Failed(e),
                                (Some(ep), Ok(action)) => match ep.step(&action).await {
                                    Ok(outcome) => EnvReply::Stepped {
                                        outcome: json(&outcome),
                                        observation: json(&ep.observation()),
                                    },
                                    Err(e) => EnvReply::Failed(e.to_string()),
                                },
                            }
                        }
                    };
                    rpc::reply(msg.reply, &reply);
                });
            }
            EnvRequest::Close { episode } => {
                let open = lock(&state.episodes).remove(&episode);
                tokio::spawn(async move {
                    if let Some(open) = open {
                        if let Some(ep) = open.episode.lock().await.take() {
                            ep.close().await;
                        }
                    }
                    rpc::reply(msg.reply, &EnvReply::Closed);
                });
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Rpc>,
        state: &mut EnvHostState,
    ) -> Result<(), ActorProcessingErr> {
        let open: Vec<Arc<OpenEpisode>> = lock(&state.episodes).drain().map(|(_, e)| e).collect();
        for e in open {
            if let Some(ep) = e.episode.lock().await.take() {
                ep.close().await;
            }
        }
        Ok(())
    }
}

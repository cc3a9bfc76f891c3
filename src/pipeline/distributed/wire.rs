//! The requests and replies that cross the wire between the job home and the rollout,
//! environment and judge hosts.

use clawrl_actors::loops::{Generated, RolloutStats, WeightAnnounce};
use serde::{Deserialize, Serialize};

use crate::model::{GenerationResult, LoraConfig, SamplingParams};

/// How a job that trains a LoRA adapter is served: the frozen base travels once, as a blob on
/// the job home's bulk plane; every version is then an adapter of this shape.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AdapterServing {
    /// The base's whole weights (safetensors, Hugging Face names); its `version` is 0 and names
    /// no weight version: only the blob (whose id the fetched bytes are verified against) and
    /// its size are read.
    pub base: WeightAnnounce,
    /// The adapter's rank, alpha and targets (validated when decoded).
    pub lora: LoraConfig,
}

/// A request to a [`RolloutHost`](super::RolloutHost).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RolloutRequest {
    /// Serve `job` (start its worker if there is none) and install `announce` (fetched over the
    /// bulk plane); replies [`RolloutReply::Stats`].
    Serve {
        /// The job id.
        job: String,
        /// The policy's `config.json` text.
        model_config: String,
        /// Engine batch size.
        max_batch: usize,
        /// Engine context.
        max_context: usize,
        /// Engine prefix-cache budget in bytes (0: off).
        prefix_cache_bytes: usize,
        /// The version to install.
        announce: WeightAnnounce,
        /// Set when the job trains a LoRA adapter: versions are adapters over this base.
        adapter: Option<AdapterServing>,
    },
    /// Generate for `job`.
    Generate {
        /// The job id.
        job: String,
        /// The prompt.
        prompt_ids: Vec<u32>,
        /// Sampling.
        params: SamplingParams,
    },
    /// Stop serving `job`.
    Release {
        /// The job id.
        job: String,
    },
}

/// A [`RolloutHost`](super::RolloutHost)'s reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum RolloutReply {
    /// The job's worker counters.
    Stats(RolloutStats),
    /// A generation, with the version of its tokens.
    Generated(Generated<GenerationResult>),
    /// This host does not serve the job (yet): ask another.
    NotServing,
    /// The request itself is bad (the engine refused it, or the config does not parse).
    Refused(String),
    /// The job's worker was stopped.
    Released,
}

/// A request to an [`EnvHost`](super::EnvHost).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum EnvRequest {
    /// Build the job's environment (once per job) and describe it.
    Describe {
        /// The job id.
        job: String,
        /// The spec's file (its directory resolves relative paths).
        file: String,
        /// The spec text.
        spec: String,
    },
    /// Start an episode of task `task_index`.
    Start {
        /// The job id.
        job: String,
        /// The spec's file.
        file: String,
        /// The spec text.
        spec: String,
        /// The task.
        task_index: u64,
        /// The episode's seed.
        seed: u64,
    },
    /// Step an episode with an action (JSON of [`clawrl_actors::loops::Action`]).
    Step {
        /// The episode.
        episode: u64,
        /// The action, as JSON text.
        action: String,
    },
    /// Close an episode.
    Close {
        /// The episode.
        episode: u64,
    },
}

/// An [`EnvHost`](super::EnvHost)'s reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum EnvReply {
    /// The job's environment.
    Described {
        /// Its kind.
        kind: String,
        /// Its task count.
        task_count: u64,
        /// Its step limit.
        max_steps: u32,
    },
    /// An episode started.
    Started {
        /// Its id on the host.
        episode: u64,
        /// The task's id.
        task_id: String,
        /// The task's instruction.
        instruction: String,
        /// The first observation (JSON of [`Observation`](clawrl_actors::loops::Observation)).
        observation: String,
    },
    /// A step's outcome and the observation after it (JSON texts).
    Stepped {
        /// JSON of [`StepOutcome`](clawrl_actors::loops::StepOutcome).
        outcome: String,
        /// JSON of [`Observation`](clawrl_actors::loops::Observation).
        observation: String,
    },
    /// The episode was closed (or was not open).
    Closed,
    /// The environment failed (the reason).
    Failed(String),
}

/// A request to a [`JudgeHost`](super::JudgeHost).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JudgeRequest {
    /// Build the job's judge (once per job and spec text) under this node's `[judge]` grants;
    /// replies [`JudgeReply::Ready`] or why it cannot.
    Prepare {
        /// The job id.
        job: String,
        /// The spec's file (its directory resolves relative paths).
        file: String,
        /// The spec text.
        spec: String,
    },
    /// Judge one turn (all its votes) with the job's judge, built first if need be.
    Judge {
        /// The job id.
        job: String,
        /// The spec's file.
        file: String,
        /// The spec text.
        spec: String,
        /// JSON of the [`Turn`](clawrl_actors::loops::Turn).
        turn: String,
    },
}

/// A [`JudgeHost`](super::JudgeHost)'s reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum JudgeReply {
    /// The job's judge is built.
    Ready,
    /// JSON of the turn's [`Judgement`](clawrl_actors::loops::Judgement).
    Judged(String),
    /// The judge could not be built or could not judge the turn, or the caller was refused
    /// (the reason).
    Failed(String),
}

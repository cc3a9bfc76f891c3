//! Jobs end to end: the judge, the method's samples, the trainer pipeline, `clawrl run` with every job kind, and their faults.

mod agent_jobs;
mod crash_run;
mod judge_gateway;
mod judge_opd;
mod judge_openai;
mod judge_parse;
mod judge_votes;
mod personal_experiment;
mod personal_job;
mod pipeline_e2e;
mod pipeline_faults;
mod run_cli;
mod toolagent_pipeline;
mod trainer_pipeline;

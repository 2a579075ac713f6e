//! infer-core: the scheduler / KV-policy core shared by the simulator and the engine.
//!
//! Pure and deterministic: no threads, no wall clock, no global RNG, and no I/O but reading
//! the trace file a scenario names ([`workload::Trace::load`], whose failure is a
//! [`FileError`], the error every crate reports files with). Time is a number the driver
//! passes in; randomness comes from seeds in the inputs.
//!
//! * [`scheduler`]: requests → step plans → events (batching, chunking, preemption);
//! * [`kv`]: contiguous and paged KV managers, prefix caching;
//! * [`workload`]: scenario files, prompts and arrival processes;
//! * [`metrics`]: TTFT / TPOT / ITL / E2E with vLLM's definitions;
//! * [`router`]: routing policies over replicas;
//! * [`hf_config`]: what a Hugging Face `config.json` means where it is silent or nested.

mod file_error;
pub mod hf_config;
pub mod kv;
pub mod metrics;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod workload;

pub use file_error::FileError;
pub use request::{FinishReason, Request, RequestId, RequestStats, StopConditions};
pub use scheduler::{
    AddError, AddOptions, BatchingMode, Event, KvAdmission, KvBackend, KvPreemption, KvVictim,
    PassSum, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerStats, SchedulingPolicy,
    SlotPasses, StepPlan, StepShape, SLOT_KEY_PAD,
};

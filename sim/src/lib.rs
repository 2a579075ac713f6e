//! infer-sim: the discrete-event simulator. It drives the very same `infer-core` scheduler
//! as the engine, with a cost model standing in for the GPU, so the only thing that can
//! differ between a prediction and a measurement is the cost model.
//!
//! * [`catalog`]: hardware and model numbers (published, with sources);
//! * [`memory`]: the start-up memory plan (weights + KV pool + activations) and each
//!   replica's activation peak;
//! * [`cost`]: the cost-model trait, the analytic roofline and the profiled fit;
//! * [`error`]: what can go wrong, naming the file and key to fix;
//! * [`calibration`]: the analytic model's coefficients and the engine's mechanisms, read
//!   from calibration files;
//! * [`fit`]: `sim calibrate`, fitting calibration files to measured runs;
//! * [`settings`]: the scenario's `[sim]` table;
//! * [`setup`]: scenario → catalog entries, memory plan and cost model;
//! * [`simulate`]: the event loop;
//! * [`output`]: console text, and runs streamed into run directories (`infer_reports`'
//!   writer);
//! * [`stages`]: per-stage figures of staged arrival schedules;
//! * [`sweep`]: grids of runs in parallel;
//! * [`plan`]: `sim plan`, the best configuration under latency objectives, and capacity;
//! * [`trust`]: how far to trust a prediction: warnings where it is fragile;
//! * [`interval`]: how far a figure may be off: 90% intervals from the workload's
//!   randomness and the calibration's measured errors.

pub mod calibration;
pub mod catalog;
pub mod cost;
pub mod error;
pub mod fit;
pub mod interval;
pub mod memory;
pub mod output;
pub mod plan;
pub mod settings;
pub mod setup;
pub mod simulate;
pub mod stages;
pub mod sweep;
pub mod trust;

pub use error::SimError;
pub use setup::{load, prepare, Setup};
pub use simulate::{run, run_collect, run_with, Rows, RunSink, RunStats, SimResult};

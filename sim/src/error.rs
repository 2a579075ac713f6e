//! The simulator's errors. Each names what the user has to fix: the file, the key in it,
//! and why.

use infer_core::workload::{ScenarioError, TraceError};
use infer_core::FileError;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file that cannot be read, created or written.
    #[error(transparent)]
    File(#[from] FileError),
    /// A scenario whose key cannot be used (its own, or a file it names).
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// A trace a scenario replays.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A key of a file (a calibration file) that cannot be used.
    #[error("{file}: key `{key}`: {reason}")]
    Key {
        file: String,
        key: String,
        reason: String,
    },
    /// A file whose content cannot be used (a calibration, a profile, a model's
    /// `config.json`, a run directory's summary, a table of published figures).
    #[error("{file}: {reason}")]
    Content { file: String, reason: String },
    /// A run's rows that could not be kept (a full disk, `sim.max_output_mib`): the run
    /// stopped.
    #[error("{0}")]
    Output(String),
    /// Input that cannot be used, where no file is involved (a profile's points that
    /// determine no fit, a sweep axis, a fit without targets).
    #[error("{0}")]
    Invalid(String),
}

impl SimError {
    pub fn content(file: impl ToString, reason: impl ToString) -> Self {
        SimError::Content {
            file: file.to_string(),
            reason: reason.to_string(),
        }
    }
}

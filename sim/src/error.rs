//! The simulator's errors. Each names what the user has to fix: the file, the key in it,
//! and why.

use std::path::PathBuf;

use infer_core::workload::{ScenarioError, TraceError};

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file that cannot be read, created or written.
    #[error("{}: cannot {action}: {error}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        /// Part of the message (not a `source`: printed once, not again by a chain).
        error: std::io::Error,
    },
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
    /// Input that cannot be used, where no file is involved (a profile's points that
    /// determine no fit, a sweep axis, a fit without targets).
    #[error("{0}")]
    Invalid(String),
}

impl SimError {
    /// For `map_err`: `path` could not be `action`ed ("read", "write", "create").
    pub fn io(
        path: impl Into<PathBuf>,
        action: &'static str,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |error| SimError::Io {
            path,
            action,
            error,
        }
    }

    pub fn content(file: impl ToString, reason: impl ToString) -> Self {
        SimError::Content {
            file: file.to_string(),
            reason: reason.to_string(),
        }
    }
}

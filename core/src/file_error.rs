//! A file the drivers could not read or write: one error type for every crate that touches
//! files (traces here, run directories and calibration files in the simulator, reports).

use std::path::PathBuf;

/// A file or directory that cannot be read, created or written: the path, what was tried,
/// and the system's reason.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot {action}: {error}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    /// "read", "write", "create".
    pub action: &'static str,
    /// Part of the message (not a `source`: printed once, not again by an error chain).
    pub error: std::io::Error,
}

impl FileError {
    /// For `map_err`: `path` could not be `action`ed.
    pub fn at(
        path: impl Into<PathBuf>,
        action: &'static str,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |error| FileError {
            path,
            action,
            error,
        }
    }
}

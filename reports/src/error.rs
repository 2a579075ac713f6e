//! The reports' errors: the file and why.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or directory that cannot be read, created or written.
    #[error("{}: cannot {action}: {error}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        /// Part of the message (not a `source`: printed once, not again by a chain).
        error: std::io::Error,
    },
    /// A run directory's file that cannot be read as what it should be; `line` (1-based,
    /// the CSV header is line 1) where the problem is one row.
    #[error("{}: {}{reason}", path.display(), line.map_or(String::new(), |l| format!("line {l}: ")))]
    Content {
        path: PathBuf,
        line: Option<usize>,
        reason: String,
    },
    /// A chart the plotting backend could not draw or write.
    #[error("{}: cannot draw: {reason}", path.display())]
    Chart { path: PathBuf, reason: String },
    #[error("no runs to report")]
    NoRuns,
}

impl ReportError {
    /// For `map_err`: `path` could not be `action`ed ("read", "write", "create").
    pub fn io(
        path: impl Into<PathBuf>,
        action: &'static str,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |error| ReportError::Io {
            path,
            action,
            error,
        }
    }
}

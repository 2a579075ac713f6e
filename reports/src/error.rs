//! The reports' errors: the file and why.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or directory that cannot be read, created or written.
    #[error(transparent)]
    File(#[from] infer_core::FileError),
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

//! infer-reports: tables, charts and comparisons (phase vs phase, predicted vs measured) built
//! from run directories. Filled by the reports issue.

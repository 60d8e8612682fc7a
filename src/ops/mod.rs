//! Operator commands beside the four stages: `list`, `inspect`, `release`,
//! `sweep`, `metrics`, and `try`, which drives a whole job like GitLab Runner would.

pub mod list;
pub mod metrics;
pub mod sweep;
pub mod try_job;

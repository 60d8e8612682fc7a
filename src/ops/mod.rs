//! Operator commands beside the four stages: `list`, `inspect`, `release`,
//! `sweep`, and `try`, which drives a whole job like GitLab Runner would.

pub mod list;
pub mod sweep;
pub mod try_job;

//! Ring allreduce schedule (placeholder while reduce.rs is built).

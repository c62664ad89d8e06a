//! Benchmarks (see BENCHMARKS.md).

//! Benchmarks behind BENCHMARKS.md, one file per concept: communication
//! ([`comm`](fn@comm), [`functions`]: `comm.rs`) and kernels ([`gemm`],
//! [`conv`]: `kernels.rs`) and the optimizers' steps ([`optim`](fn@optim):
//! `optim.rs`).

mod comm;
mod kernels;
mod optim;

pub use comm::{comm, functions, memcpy_seconds, COMM_OPS};
pub use kernels::{conv, gemm, gemm_rate, VGG16_CONV_SHAPES};
pub use optim::optim;

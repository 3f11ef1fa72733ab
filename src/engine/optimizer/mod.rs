//! The optimizer pipeline: fp32 master weights and Adam moments per
//! sub-group on their tier, stepped on a thread of their own.
//!
//! - [`state`]: [`state::OptimizerState`], the state of every sub-group in
//!   host memory or on NVMe and the pipelined read / step / write.
//! - [`worker`]: [`worker::OptimizerWorker`], the optimizer thread that owns
//!   the state and runs Adam while backward goes on.

pub mod state;
pub mod worker;

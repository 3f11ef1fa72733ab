//! tierzero: train models larger than GPU memory by streaming parameters,
//! gradients and optimizer state between device memory, pinned host memory
//! and NVMe. See `ARCHITECTURE.md` for the map of modules and invariants.
#![deny(unsafe_code)]

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod durable;
pub mod engine;
pub mod estimate;
pub mod eval;
pub mod failpoint;
pub mod gpu;
pub mod le;
pub mod model;
pub mod optim;
pub mod run;
pub mod sha256;
pub mod units;
pub(crate) mod wide;

//! Parameters: where each one lives and how it reaches the compute thread.
//!
//! - [`store`]: the [`store::ParamStore`], one home tier per param and one
//!   state map per tensor, driven by the closed [`store::ParamEvent`] enum.
//! - `copier`: the param copy thread, which takes landed NVMe reads out of
//!   their swap buffers off the compute thread.
//! - [`prefetch`]: the [`prefetch::Prefetcher`]: the unit trace, the
//!   prefetch window and the release policy.

pub(crate) mod copier;
pub mod prefetch;
pub mod store;

//! What a run shows about itself: per-step metrics and the summary
//! ([`metrics`]), and the Chrome-trace timeline of a few steps
//! ([`timeline`]).

pub mod metrics;
pub mod timeline;

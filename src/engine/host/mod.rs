//! The host the engine runs on: how many threads compute and where they
//! run (`threads`), and the process's malloc settings (`heap`).

pub(crate) mod heap;
pub mod threads;

//! The host the engine runs on: how many threads compute and where they
//! run (`threads`), and the process's malloc settings (`heap`).

pub mod heap;
pub mod threads;

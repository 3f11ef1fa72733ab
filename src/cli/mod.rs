//! Subcommands of the `tierzero` binary. Each subcommand lives in its own
//! file with its `clap::Args` struct and a `run(args) -> anyhow::Result<()>`.

pub mod bench_adam;

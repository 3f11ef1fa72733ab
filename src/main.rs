//! The `tierzero` command-line tool.
//!
//! Exit codes: 0 success; 2 bad input (clap reports it); 1 internal failure
//! (the error chain is printed, no backtrace).
#![deny(unsafe_code)]

mod cli;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tierzero",
    version,
    about = "Train models larger than GPU memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmark the CPU AdamW kernels against a memory-bandwidth probe and
    /// the two-pass (step, then convert) baseline.
    BenchAdam(cli::bench_adam::BenchAdamArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::BenchAdam(args) => cli::bench_adam::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

//! The `tierzero` binary. See `cli` for commands and exit codes.
#![deny(unsafe_code)]

mod cli;

fn main() {
    std::process::exit(cli::main());
}

//! The `tierzero` binary. See `cli` for commands and exit codes.
#![deny(unsafe_code)]

mod cli;

fn main() {
    // A full disk simulated by RLIMIT_FSIZE (or a real file-size limit) must
    // be an error naming the file, not a kill by SIGXFSZ.
    tierzero_swap::space::ignore_sigxfsz();
    std::process::exit(cli::main());
}

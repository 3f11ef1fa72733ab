//! The `tierzero` binary. See `cli` for commands and exit codes.
#![deny(unsafe_code)]

mod cli;

fn main() {
    // A full disk simulated by RLIMIT_FSIZE (or a real file-size limit) must
    // be an error naming the file, not a kill by SIGXFSZ.
    tierzero_swap::space::ignore_sigxfsz();
    // Before any thread starts: glibc's arena cap only stops arenas not
    // yet made, and a thread that made its own before the cap keeps it and
    // shares it with later threads (see `tierzero::engine::host::heap`).
    let _ = tierzero::engine::host::heap::keep_heap_mapped();
    std::process::exit(cli::main());
}

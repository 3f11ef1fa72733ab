//! The `tierzero` binary. See `cli` for commands and exit codes.
#![deny(unsafe_code)]

mod cli;

fn main() {
    // A full disk simulated by RLIMIT_FSIZE (or a real file-size limit) must
    // be an error naming the file, not a kill by SIGXFSZ.
    tierzero_swap::space::ignore_sigxfsz();
    // A soft open-file limit of 1024 is systemd's default for select(2)'s
    // sake; a run with many swap files, rings and checkpoint files is not
    // held to it (the hard limit stays; meeting it is exit 2 with the fix).
    let _ = tierzero_swap::process::raise_open_file_limit();
    // Before any thread starts: glibc's arena cap only stops arenas not
    // yet made, and a thread that made its own before the cap keeps it and
    // shares it with later threads (see `tierzero::engine::host::heap`).
    let _ = tierzero::engine::host::heap::keep_heap_mapped();
    std::process::exit(cli::main());
}

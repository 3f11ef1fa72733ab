//! Running the built `tierzero` binary from integration tests.
#![allow(clippy::expect_used, dead_code)] // tests; not every test file uses every helper

use std::path::Path;
use std::process::Command;

/// What a run of the binary produced.
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tierzero ARGS...`, in `cwd` when given.
pub fn run_tierzero(cwd: Option<&Path>, args: &[&str]) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierzero"));
    cmd.args(args);
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let out = cmd.output().expect("run tierzero");
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

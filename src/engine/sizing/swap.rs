//! The swap spaces a rank makes: one per use, under the use's configured
//! `nvme_path` (this rank's `rank<R>/` below it with several ranks), each
//! the payload the sizing policy counts plus [`SWAP_SLACK_BYTES`].

use std::path::Path;

use super::Sizing;
use crate::config::Config;

/// Bytes each swap space gets beyond its payload: room for the
/// allocator's alignment of every extent.
pub const SWAP_SLACK_BYTES: u64 = 1 << 20;

/// What a swap space holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapUse {
    /// The NVMe tier's param shards (`offload_param`).
    Params,
    /// The optimizer state's extents and the spilled gradients
    /// (`offload_optimizer`).
    OptimizerState,
    /// Partial gradient sums parked between micro-batches
    /// (`offload_optimizer`'s path).
    GradPark,
}

impl SwapUse {
    /// Every use, in the order the trainer makes their spaces.
    pub const ALL: [SwapUse; 3] = [SwapUse::Params, SwapUse::OptimizerState, SwapUse::GradPark];

    /// What it holds, in words.
    pub fn what(self) -> &'static str {
        match self {
            SwapUse::Params => "the params",
            SwapUse::OptimizerState => "the optimizer state",
            SwapUse::GradPark => "the parked gradients",
        }
    }

    /// The config key of its directory.
    pub fn path_key(self) -> &'static str {
        match self {
            SwapUse::Params => "zero_optimization.offload_param.nvme_path",
            SwapUse::OptimizerState | SwapUse::GradPark => {
                "zero_optimization.offload_optimizer.nvme_path"
            }
        }
    }

    /// The config key that keeps it in host memory instead.
    pub fn device_key(self) -> &'static str {
        match self {
            SwapUse::Params => "zero_optimization.offload_param.device",
            SwapUse::OptimizerState | SwapUse::GradPark => {
                "zero_optimization.offload_optimizer.device"
            }
        }
    }

    /// Its configured directory, when it goes to NVMe at all.
    pub fn nvme_path(self, config: &Config) -> Option<&Path> {
        let zero = &config.zero;
        match self {
            SwapUse::Params => zero.offload_param.device.nvme_path(),
            SwapUse::OptimizerState | SwapUse::GradPark => {
                zero.offload_optimizer.device.nvme_path()
            }
        }
    }
}

impl Sizing {
    /// The bytes of `what`'s swap space, `None` when the run makes none:
    /// its payload and [`SWAP_SLACK_BYTES`].
    pub fn swap_space_bytes(&self, config: &Config, what: SwapUse) -> Option<u64> {
        what.nvme_path(config)?;
        let payload_bytes = match what {
            SwapUse::Params => self.params_on_nvme().then_some(self.param_nvme_bytes)?,
            SwapUse::OptimizerState => self
                .optimizer_nvme_bytes
                .saturating_add(self.grad_spill_nvme_bytes),
            SwapUse::GradPark => self.park_grads.then_some(self.grad_park_nvme_bytes)?,
        };
        Some(payload_bytes.saturating_add(SWAP_SLACK_BYTES))
    }

    /// Every swap space this rank makes on `dir`'s file system: the sum of
    /// [`Sizing::swap_space_bytes`] over the uses configured there, in
    /// `dir` or in another directory of the same file system (the params'
    /// `tdisk/p` beside the optimizer's `tdisk/o`, or one directory spelled
    /// two ways: the auto speculation pool was sized as if the other
    /// use's file were elsewhere, and the run then refused for space).
    pub fn swap_bytes_under(&self, config: &Config, dir: &Path) -> u64 {
        SwapUse::ALL
            .into_iter()
            .filter(|u| {
                u.nvme_path(config)
                    .is_some_and(|p| same_file_system(p, dir))
            })
            .filter_map(|u| self.swap_space_bytes(config, u))
            .fold(0, u64::saturating_add)
    }
}

/// Whether `a` and `b` (directories, made or not) are on one file system:
/// their nearest existing ancestors' devices, or the paths themselves
/// where a device is not known.
pub fn same_file_system(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    match (file_system_id(a), file_system_id(b)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// `path`'s nearest existing ancestor, itself included (`.` for a
/// relative path's first component): where a directory not made yet will
/// be, for its file system.
pub fn nearest_existing(path: &Path) -> Option<&Path> {
    path.ancestors()
        .map(|p| {
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            }
        })
        .find(|p| p.exists())
}

/// The available bytes (`statvfs`) of the file system `path` is or will be
/// on ([`nearest_existing`]); `None` when that cannot be read.
pub fn available_bytes_at(path: &Path) -> Option<u64> {
    let dir = nearest_existing(path)?;
    tierzero_swap::space::filesystem_space(dir)
        .ok()
        .map(|s| s.available_bytes)
}

/// The device of `dir`'s nearest existing ancestor.
fn file_system_id(dir: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(nearest_existing(dir)?)
        .ok()
        .map(|m| m.dev())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    #[test]
    fn two_directories_of_one_file_system_are_one_file_system() {
        let d = std::env::temp_dir().join(format!("tz-fs-{}", std::process::id()));
        std::fs::create_dir_all(d.join("p")).unwrap();
        // Made or not yet made, spelled as the same path or not.
        assert!(same_file_system(&d.join("p"), &d.join("o")));
        assert!(same_file_system(&d.join("o/x"), &d.join("o/x")));
        assert!(same_file_system(&d.join("p"), &d.join("p/../p")));
        // /proc is a file system of its own wherever it is mounted.
        if Path::new("/proc/self").exists() {
            assert!(!same_file_system(&d, Path::new("/proc/self")));
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}

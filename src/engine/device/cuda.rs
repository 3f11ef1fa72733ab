//! [`CudaLink`]: the device tier on a GPU (`tierzero_gpu`). The uploads
//! are [`tierzero_gpu::link::Uploads`]: pinned staging, the h2d stream,
//! and a compute stream that waits on each copy's event. The compute is
//! the CUDA units ([`tierzero_gpu::unit::CudaExec`]).
//!
//! # Its share of the device
//!
//! The params on the tier may hold half of the device budget left after
//! start-up (`tierzero.device_budget_bytes`, or the free memory less 5%,
//! less the kernels' and cuBLAS's workspace). The other half is left for
//! the unit's activations and temporaries. The plan prints both halves. A
//! unit whose temporaries do not fit fails with the device's
//! `OutOfBudget`, which gives the numbers.

use std::sync::Arc;

use tierzero_gpu::device::{Device, DeviceBuffer};
use tierzero_gpu::link::{PendingUpload, Uploads};
use tierzero_gpu::unit::{CudaExec, GemmDtype};

use super::DeviceLink;
use crate::model::exec_units::gpu_err;
use crate::model::ModelError;

/// Pinned staging memory for the uploads: a few units' worth is enough
/// for a window one unit ahead.
pub const STAGING_CAP_BYTES: u64 = 256 << 20;

/// The device tier's link to a GPU.
#[derive(Debug)]
pub struct CudaLink {
    uploads: Uploads,
    gemm: GemmDtype,
    budget_bytes: u64,
}

impl CudaLink {
    /// The link to `dev`; the tier's params may hold half of what its
    /// budget has left.
    pub fn new(dev: Arc<Device>, gemm: GemmDtype) -> Self {
        let b = dev.budget();
        let budget_bytes = b.budget_bytes().saturating_sub(b.used_bytes()) / 2;
        CudaLink {
            uploads: Uploads::new(dev, STAGING_CAP_BYTES),
            gemm,
            budget_bytes,
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        self.uploads.device()
    }
}

impl DeviceLink for CudaLink {
    type Buf = DeviceBuffer<f32>;
    type Exec<'a> = CudaExec<'a>;
    type Upload = PendingUpload;

    fn exec(&self) -> CudaExec<'_> {
        CudaExec {
            dev: self.uploads.device(),
            gemm: self.gemm,
        }
    }

    fn describe(&self) -> String {
        let d = self.uploads.device();
        let b = d.budget();
        format!(
            "cuda:{} {} (sm_{}), {:?} GEMMs; device budget {} ({} for the params on the \
             device tier, the rest for activations, temporaries and cuBLAS)",
            d.ordinal(),
            d.name(),
            d.arch(),
            self.gemm,
            crate::units::format_bytes(b.budget_bytes()),
            crate::units::format_bytes(self.budget_bytes),
        )
    }

    fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    fn upload(&self, what: &str, host: &[f32]) -> Result<PendingUpload, ModelError> {
        self.uploads.start(what, host).map_err(gpu_err)
    }

    fn finish(&self, upload: PendingUpload) -> Result<DeviceBuffer<f32>, ModelError> {
        self.uploads.finish(upload).map_err(gpu_err)
    }

    fn free(&self, buf: DeviceBuffer<f32>) {
        drop(buf);
    }
}

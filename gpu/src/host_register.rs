//! Host memory registered with CUDA ([`HostRegistration`]): the engine's
//! pinned arenas made readable by the copy engine in place, so a param's
//! upload is one DMA from its page ([`crate::link::Uploads::start_pinned`])
//! instead of a host copy into a staging buffer and a DMA from there.
//!
//! # The contract
//!
//! The arena (`tierzero_swap::PinnedArena`) calls
//! [`HostRegistrar::register`] once with its whole mapping after it is
//! mapped and locked, and [`HostRegistrar::unregister`] once before it
//! unmaps it. In between, CUDA touches the memory only through the copies
//! we issue, and each of those holds a `tierzero_swap::ReadPin` of its
//! range until its event completed. Registration is `PORTABLE`: the
//! memory is pinned for every context, not only the one current now. It
//! is plain page-locked memory (not write-combined): the CPU reads these
//! pages too.

use std::sync::Arc;

use cudarc::driver::sys;
use tierzero_swap::HostRegistrar;

use crate::device::Device;

/// Registers arenas with `dev`'s CUDA context (see the module docs).
#[derive(Debug)]
pub struct HostRegistration {
    dev: Arc<Device>,
}

impl HostRegistration {
    /// A registrar for `dev`.
    pub fn new(dev: Arc<Device>) -> Self {
        HostRegistration { dev }
    }
}

impl HostRegistrar for HostRegistration {
    fn register(&self, addr: usize, len_bytes: usize) -> std::io::Result<()> {
        let ctx = self.dev.context();
        ctx.bind_to_thread()
            .or_else(|_| ctx.bind_to_thread())
            .map_err(|e| std::io::Error::other(format!("cuCtxSetCurrent: {e}")))?;
        // SAFETY: [addr, addr + len_bytes) is the arena's live mapping (the
        // arena's contract: registered after mapping, unregistered before
        // unmapping). Registering only pins it and maps it for the device;
        // the device reads or writes it only through copies that hold a
        // pin of their range until their event completed.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(
                addr as *mut std::ffi::c_void,
                len_bytes,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        rc.result().map_err(|e| {
            std::io::Error::other(format!(
                "cuMemHostRegister of {len_bytes} bytes at {addr:#x}: {e}"
            ))
        })
    }

    fn unregister(&self, addr: usize, _len_bytes: usize) {
        // A first failure may be an error cudarc kept from an earlier
        // drop (it hands it to the next bind and clears it): try again
        // before leaving the range registered.
        let ctx = self.dev.context();
        if let Err(e) = ctx.bind_to_thread().or_else(|_| ctx.bind_to_thread()) {
            tracing::warn!(error = %e, "cuCtxSetCurrent before cuMemHostUnregister failed");
            return;
        }
        // SAFETY: `addr` is the base this registrar registered; the arena
        // calls this once, before it unmaps, when no buffer (and so no
        // pin, and no copy) is left.
        let rc = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
        if let Err(e) = rc.result() {
            tracing::warn!(error = %e, addr, "cuMemHostUnregister failed");
        }
    }
}

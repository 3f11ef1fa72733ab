//! A [`Buffer`] read in place by other threads and by a DMA engine while
//! one owner writes it now and then: [`SharedBuffer`].
//!
//! # Why not an `RwLock`
//!
//! A cpu-tier page of the engine holds many params' bytes. The param copy
//! thread reads a range of it, and a GPU's copy engine reads a range
//! straight from it (the arena registered with CUDA, so the copy is DMA,
//! with no staging copy). The DMA read outlives every call on the host:
//! it ends when the copy's event completes, on a stream, seen from
//! whichever thread notices. So the read lock must be an owned value that
//! travels with the copy to any thread and is let go there: a
//! [`ReadPin`]. `std`'s guards borrow their lock and cannot leave the
//! thread that took them.
//!
//! # The rules
//!
//! * A [`ReadPin`] is a byte range of the buffer that nobody writes while
//!   the pin lives. It is `Send` and `'static` (it holds the buffer, and
//!   through it the arena's mapping), and it is dropped on any thread.
//! * [`SharedBuffer::write`] waits until no pin is held, and while its
//!   [`WriteGuard`] lives no pin is given. So a copy engine never reads a
//!   range the host is writing, and the host never writes one a copy may
//!   still read: invariant 1 of the arena (a buffer the kernel or a DMA
//!   engine may still touch is never reused) extended to ranges.
//! * Pins do not queue behind a waiting writer: a thread that holds a pin
//!   and takes another never deadlocks on its own writer. Write-backs
//!   are rare (after an optimizer step) and pins short (one copy), so the
//!   writer is not starved in practice; [`SharedBuffer::write`] says how
//!   long it waited, for the caller's metrics.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::arena::{Buffer, HostRegistrar, PinnedArena};
use crate::error::{Result, SwapError};

/// Readers and the writer of one buffer.
#[derive(Debug, Default)]
struct Holders {
    /// Pins alive.
    pins: usize,
    /// A [`WriteGuard`] alive.
    writing: bool,
}

struct Inner {
    buf: UnsafeCell<Buffer>,
    holders: Mutex<Holders>,
    changed: Condvar,
}

// SAFETY: the buffer's bytes are reached only through a `ReadPin` (shared
// reads, given only while no writer holds the buffer) or a `WriteGuard`
// (exclusive, given only while no pin and no other writer lives); the
// counts that enforce this are behind the mutex. `Buffer` itself is Send.
unsafe impl Sync for Inner {}
// SAFETY: as for `Sync`; the buffer moves with its `Arc`.
unsafe impl Send for Inner {}

impl Inner {
    fn holders(&self) -> MutexGuard<'_, Holders> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The buffer, for fields that never change (its arena, its length).
    fn buffer(&self) -> &Buffer {
        // SAFETY: only shared references to the `Buffer` value are ever
        // made (a `WriteGuard` writes its bytes through their address,
        // never through a `&mut Buffer`), and nothing replaces the value.
        unsafe { &*self.buf.get() }
    }
}

/// A buffer shared between pinned readers and one writer (see the module
/// docs).
#[derive(Clone)]
pub struct SharedBuffer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = self.inner.holders();
        f.debug_struct("SharedBuffer")
            .field("bytes", &self.len_bytes())
            .field("pins", &h.pins)
            .field("writing", &h.writing)
            .finish()
    }
}

impl SharedBuffer {
    /// Shares `buf`.
    pub fn new(buf: Buffer) -> Self {
        SharedBuffer {
            inner: Arc::new(Inner {
                buf: UnsafeCell::new(buf),
                holders: Mutex::new(Holders::default()),
                changed: Condvar::new(),
            }),
        }
    }

    /// The buffer's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.inner.buffer().capacity_bytes() as usize
    }

    /// The arena the buffer is in.
    pub fn arena(&self) -> &Arc<PinnedArena> {
        self.inner.buffer().arena()
    }

    /// Pins alive now.
    pub fn pins(&self) -> usize {
        self.inner.holders().pins
    }

    /// A read pin of `range` (waits while a writer holds the buffer).
    pub fn pin(&self, range: Range<usize>) -> Result<ReadPin> {
        if range.start > range.end || range.end > self.len_bytes() {
            return Err(SwapError::Config(format!(
                "pin of bytes {range:?} in a shared buffer of {} bytes",
                self.len_bytes()
            )));
        }
        let mut h = self.inner.holders();
        while h.writing {
            h = self
                .inner
                .changed
                .wait(h)
                .unwrap_or_else(|p| p.into_inner());
        }
        h.pins += 1;
        Ok(ReadPin {
            inner: self.inner.clone(),
            range,
        })
    }

    /// The buffer for writing, once no pin and no other writer is left,
    /// and how long that took.
    pub fn write(&self) -> (WriteGuard<'_>, Duration) {
        let start = Instant::now();
        let mut h = self.inner.holders();
        while h.writing || h.pins > 0 {
            h = self
                .inner
                .changed
                .wait(h)
                .unwrap_or_else(|p| p.into_inner());
        }
        h.writing = true;
        (WriteGuard { inner: &self.inner }, start.elapsed())
    }
}

/// A byte range of a [`SharedBuffer`] that nobody writes while this
/// lives. Send it with the copy that reads it; drop it when that copy is
/// done.
pub struct ReadPin {
    inner: Arc<Inner>,
    range: Range<usize>,
}

impl std::fmt::Debug for ReadPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadPin")
            .field("range", &self.range)
            .finish_non_exhaustive()
    }
}

impl ReadPin {
    /// The pinned bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: while this pin lives the holders count it, so no
        // `WriteGuard` exists (`write` waits for `pins == 0`) and none is
        // made; the range was checked against the buffer's length; the
        // `Arc` keeps the buffer, and the buffer keeps the arena's mapping.
        let all = unsafe { (*self.inner.buf.get()).as_slice() };
        &all[self.range.clone()]
    }

    /// Another pin of the same range, for a second reader (e.g. a copy
    /// engine's upload while the first pin stays with its owner). The
    /// buffer is written again only once both are gone.
    pub fn share(&self) -> ReadPin {
        self.inner.holders().pins += 1;
        ReadPin {
            inner: self.inner.clone(),
            range: self.range.clone(),
        }
    }

    /// The pinned range's offset in its buffer, in bytes.
    pub fn offset_bytes(&self) -> usize {
        self.range.start
    }

    /// The pinned range's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.range.len()
    }

    /// The arena the bytes are in.
    pub fn arena(&self) -> &Arc<PinnedArena> {
        self.inner.buffer().arena()
    }

    /// Whether the bytes' arena was registered through `registrar` (e.g.
    /// with CUDA: its copy engine may read them directly).
    pub fn registered_with(&self, registrar: &Arc<dyn HostRegistrar>) -> bool {
        self.arena()
            .registrar()
            .is_some_and(|r| std::ptr::addr_eq(Arc::as_ptr(r), Arc::as_ptr(registrar)))
    }
}

impl Drop for ReadPin {
    fn drop(&mut self) {
        let mut h = self.inner.holders();
        h.pins -= 1;
        if h.pins == 0 {
            self.inner.changed.notify_all();
        }
    }
}

/// Exclusive access to a [`SharedBuffer`]'s bytes: no pin lives while
/// this does.
pub struct WriteGuard<'a> {
    inner: &'a Inner,
}

impl std::fmt::Debug for WriteGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGuard").finish_non_exhaustive()
    }
}

impl WriteGuard<'_> {
    /// The bytes, to read.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: this guard is the only holder (`writing` set, no pins).
        unsafe { (*self.inner.buf.get()).as_slice() }
    }

    /// The bytes, to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // Through the bytes' address, not a `&mut Buffer`: other clones may
        // hold `&Buffer` meanwhile (its length, its arena), which a
        // `&mut` to the `Buffer` value would alias. The bytes themselves
        // are in the arena's mapping.
        let b = self.inner.buffer();
        let (ptr, len) = (b.bytes_ptr(), b.capacity_bytes() as usize);
        // SAFETY: this guard is the only holder of the bytes (`writing`
        // set, no pins, so no `ReadPin::bytes` or other guard's slice
        // lives), `&mut self` makes this the only slice through it, and
        // [ptr, ptr + len) is the buffer's range of the live mapping (the
        // `Arc` keeps the buffer, the buffer keeps the arena).
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        let mut h = self.inner.holders();
        h.writing = false;
        self.inner.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::arena::{ArenaConfig, LockPolicy};

    fn shared(bytes: u64) -> SharedBuffer {
        let mut c = ArenaConfig::new(bytes, bytes);
        c.lock = LockPolicy::Off;
        SharedBuffer::new(PinnedArena::new(c).unwrap().try_acquire().unwrap())
    }

    #[test]
    fn a_write_waits_for_every_pin_and_a_pin_for_the_write() {
        let s = shared(4096);
        s.write().0.as_mut_slice()[..4].copy_from_slice(&[1, 2, 3, 4]);
        let pin = s.pin(0..4).unwrap();
        let other = s.pin(2..8).unwrap();
        assert_eq!(s.pins(), 2);
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = s.clone();
        let writer = std::thread::spawn(move || {
            let start = Instant::now();
            let (mut g, waited) = s2.write();
            let done = Instant::now();
            g.as_mut_slice()[..4].copy_from_slice(&[9, 9, 9, 9]);
            tx.send((start, waited, done)).unwrap();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "the write went ahead of two pins");
        // A pin is let go on another thread, as a copy's completion is.
        std::thread::spawn(move || drop(other)).join().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "the write went ahead of a pin");
        assert_eq!(pin.bytes(), &[1, 2, 3, 4]);
        let last_pin_dropped = Instant::now();
        drop(pin);
        let (start, waited, done) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        // The write got the buffer only after the last pin went, and the
        // wait it reports is within its own call (not a fixed length: the
        // writer thread may have started late).
        assert!(
            done >= last_pin_dropped,
            "the write went ahead of the last pin"
        );
        assert!(waited <= done - start, "waited {waited:?}");
        writer.join().unwrap();
        assert_eq!(s.pin(0..4).unwrap().bytes(), &[9, 9, 9, 9]);
        assert_eq!(s.pins(), 0);
    }

    #[test]
    fn a_pin_waits_while_the_buffer_is_written() {
        let s = shared(4096);
        let (g, _) = s.write();
        let s2 = s.clone();
        let reader = std::thread::spawn(move || s2.pin(0..1).unwrap().bytes()[0]);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!reader.is_finished(), "a pin was given during a write");
        let mut g = g;
        g.as_mut_slice()[0] = 7;
        drop(g);
        assert_eq!(reader.join().unwrap(), 7);
    }

    #[test]
    fn a_pin_outside_the_buffer_is_refused_and_a_held_pin_keeps_the_arena() {
        let s = shared(4096);
        assert!(s.pin(4000..4097).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 8..4;
        assert!(s.pin(backwards).is_err());
        let pin = s.pin(4090..4096).unwrap();
        assert_eq!((pin.offset_bytes(), pin.len_bytes()), (4090, 6));
        drop(s);
        // The buffer and its arena live on in the pin.
        assert_eq!(pin.bytes().len(), 6);
        assert_eq!(pin.arena().count(), 1);
    }

    #[test]
    fn a_buffer_held_by_pins_alone_goes_back_to_its_arena_with_the_last() {
        let mut c = ArenaConfig::new(8192, 4096);
        c.lock = LockPolicy::Off;
        let arena = PinnedArena::new(c).unwrap();
        let mut buf = arena.try_acquire().unwrap();
        buf.as_mut_slice()[..3].copy_from_slice(&[5, 6, 7]);
        let pin = SharedBuffer::new(buf).pin(0..3).unwrap();
        assert_eq!(arena.free_count(), 1, "the pin holds the buffer");
        let shared = pin.share();
        assert_eq!(
            (shared.offset_bytes(), shared.bytes()),
            (0, &[5u8, 6, 7][..])
        );
        drop(pin);
        assert_eq!(arena.free_count(), 1, "the shared pin still holds it");
        std::thread::spawn(move || drop(shared)).join().unwrap();
        assert_eq!(arena.free_count(), 2, "back with the last pin");
    }

    #[derive(Debug, Default)]
    struct Counting(std::sync::atomic::AtomicUsize);

    impl HostRegistrar for Counting {
        fn register(&self, _addr: usize, _len_bytes: usize) -> std::io::Result<()> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn unregister(&self, _addr: usize, _len_bytes: usize) {}
    }

    #[test]
    fn a_pin_knows_which_registrar_registered_its_arena() {
        let ours: Arc<dyn HostRegistrar> = Arc::new(Counting::default());
        let theirs: Arc<dyn HostRegistrar> = Arc::new(Counting::default());
        let mut c = ArenaConfig::new(4096, 4096);
        c.lock = LockPolicy::Off;
        c.registrar = Some(ours.clone());
        let s = SharedBuffer::new(PinnedArena::new(c).unwrap().try_acquire().unwrap());
        let pin = s.pin(0..16).unwrap();
        assert!(pin.registered_with(&ours));
        assert!(!pin.registered_with(&theirs));
        assert!(!shared(4096).pin(0..16).unwrap().registered_with(&ours));
    }
}

//! The file I/O's workers: the io_uring ring thread ([`RingWorker`]:
//! pieces submitted as their part arrives, every completion checked) and
//! the portable `pread`/`pwrite` one, with the bounce buffers of
//! unaligned pieces (see the [`super`] docs: what is in flight, and who
//! owns its memory).

use super::*;

pub(super) fn build_ring(qd: u32) -> Result<IoUring> {
    let entries = qd.next_power_of_two().max(2);
    IoUring::builder()
        .setup_single_issuer()
        .setup_coop_taskrun()
        .build(entries)
        .or_else(|_| IoUring::new(entries))
        .map_err(|source| SwapError::Setup {
            what: "io_uring setup for file I/O".into(),
            source,
        })
}

/// The portable worker: each part's pieces in order, `pread`/`pwrite`.
pub(super) fn portable_worker(shared: &Arc<Shared>, rx: Receiver<Part>) {
    let mut arena: Option<Arc<PinnedArena>> = None;
    while let Ok(part) = rx.recv() {
        let align = part.op.file.alignment;
        let block = align.round_up(shared.block_bytes);
        let mut error = None;
        for mut piece in cut_pieces(0, &part, align, block, part.op.file.is_direct()) {
            if let Err(e) = run_piece_sync(shared, &part.op, &mut piece, &mut arena, align, block) {
                error = Some(e);
                break;
            }
        }
        shared.part_done(&part.op, error);
    }
}

fn take_bounce(
    arena: &mut Option<Arc<PinnedArena>>,
    align: Alignment,
    block: u64,
) -> Result<Buffer> {
    let a = match arena {
        Some(a) if bounces(a, align, block) => a.clone(),
        _ => {
            let a = bounce_arena(align, block)?;
            *arena = Some(a.clone());
            a
        }
    };
    a.acquire()
}

fn run_piece_sync(
    shared: &Shared,
    op: &OpState,
    piece: &mut PieceTask,
    arena: &mut Option<Arc<PinnedArena>>,
    align: Alignment,
    block: u64,
) -> Result<()> {
    if piece.way == Way::Bounce {
        piece.bounce = Some(take_bounce(arena, align, block)?);
        if op.op == IoOp::Write {
            bounce_copy(op, piece, true);
        }
    }
    loop {
        let (fd, ptr, len, off) = target(op, piece, align);
        // SAFETY: `ptr..ptr+len` is inside the piece's bounce buffer or the
        // op's HostMemory (see `target`), both alive for this call; `fd` is
        // open while the op holds its IoFile.
        let raw = unsafe {
            match op.op {
                IoOp::Read => libc::pread(fd, ptr.cast(), len as usize, off as libc::off_t),
                IoOp::Write => libc::pwrite(fd, ptr.cast(), len as usize, off as libc::off_t),
            }
        };
        let raw = if raw < 0 {
            -(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO) as i64)
        } else {
            raw as i64
        };
        match shared.check(op, piece, raw) {
            Outcome::Done => break,
            Outcome::Again => continue,
            Outcome::Failed(e) => return Err(e),
        }
    }
    if op.op == IoOp::Read && piece.way == Way::Bounce {
        bounce_copy(op, piece, false);
    }
    piece.bounce = None;
    Ok(())
}

struct PartState {
    part: Part,
    pending: usize,
    error: Option<SwapError>,
}

pub(super) struct RingWorker {
    ring: IoUring,
    shared: Arc<Shared>,
    qd: usize,
    single_submit: bool,
    overlap: bool,
    parts: Vec<Option<PartState>>,
    free_parts: Vec<usize>,
    queue: VecDeque<PieceTask>,
    slots: Vec<Option<PieceTask>>,
    free_slots: Vec<usize>,
    in_flight: usize,
    arena: Option<Arc<PinnedArena>>,
}

impl RingWorker {
    pub(super) fn new(ring: IoUring, shared: Arc<Shared>, cfg: &FileIoConfig) -> Self {
        let qd = cfg.queue_depth as usize;
        RingWorker {
            ring,
            shared,
            qd,
            single_submit: cfg.single_submit,
            overlap: cfg.overlap_events,
            parts: Vec::new(),
            free_parts: Vec::new(),
            queue: VecDeque::new(),
            slots: (0..qd).map(|_| None).collect(),
            free_slots: (0..qd).rev().collect(),
            in_flight: 0,
            arena: None,
        }
    }

    pub(super) fn run(mut self, rx: Receiver<Part>) {
        // Dropped before `self` (a local drops before the parameters).
        let _abort = crate::ring::AbortOnUnwind("file I/O ring");
        let mut backoff = crate::ring::EnterBackoff::default();
        let mut open = true;
        loop {
            if open && self.queue.is_empty() && self.in_flight == 0 {
                match rx.recv() {
                    Ok(p) => self.accept(p),
                    Err(_) => open = false,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(p) => self.accept(p),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            if !open && self.queue.is_empty() && self.in_flight == 0 {
                return;
            }
            if self.overlap || self.in_flight == 0 {
                self.push();
            }
            if self.in_flight > 0 {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => backoff.ok(),
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                        ) => {}
                    // What is in flight still completes below; wait for it
                    // without spinning.
                    Err(e) => backoff.failed(&e, "file I/O"),
                }
                self.reap();
            }
        }
    }

    fn accept(&mut self, part: Part) {
        let idx = self.free_parts.pop().unwrap_or_else(|| {
            self.parts.push(None);
            self.parts.len() - 1
        });
        let align = part.op.file.alignment;
        let block = align.round_up(self.shared.block_bytes);
        let pieces = cut_pieces(idx, &part, align, block, part.op.file.is_direct());
        let n = pieces.len();
        self.parts[idx] = Some(PartState {
            part,
            pending: n,
            error: None,
        });
        self.queue.extend(pieces);
        if n == 0 {
            self.finish_part(idx);
        }
    }

    fn push(&mut self) {
        let mut pushed_any = false;
        while self.in_flight < self.qd {
            let Some(mut piece) = self.queue.pop_front() else {
                break;
            };
            let Some(ps) = self.parts[piece.part].as_ref() else {
                continue;
            };
            if ps.error.is_some() {
                self.piece_done(piece, None);
                continue;
            }
            let op = ps.part.op.clone();
            let align = op.file.alignment;
            if piece.way == Way::Bounce && piece.bounce.is_none() {
                let block = align.round_up(self.shared.block_bytes);
                let got = match &self.arena {
                    Some(a) if bounces(a, align, block) => a.try_acquire(),
                    _ if self.in_flight > 0 => {
                        // A new arena only once nothing holds the old one's buffers.
                        Err(SwapError::Shutdown)
                    }
                    _ => take_bounce(&mut self.arena, align, block),
                };
                match got {
                    Ok(b) => piece.bounce = Some(b),
                    Err(e) if self.in_flight == 0 => {
                        self.piece_done(piece, Some(e));
                        continue;
                    }
                    Err(_) => {
                        // Wait for a bounce buffer to come back.
                        self.queue.push_front(piece);
                        break;
                    }
                }
                if op.op == IoOp::Write {
                    bounce_copy(&op, &mut piece, true);
                }
            }
            let Some(slot) = self.free_slots.pop() else {
                self.queue.push_front(piece);
                break;
            };
            let (fd, ptr, len, off) = target(&op, &mut piece, align);
            let entry = match op.op {
                IoOp::Read => opcode::Read::new(types::Fd(fd), ptr, len)
                    .offset(off)
                    .build(),
                IoOp::Write => opcode::Write::new(types::Fd(fd), ptr, len)
                    .offset(off)
                    .build(),
            }
            .user_data(slot as u64);
            // SAFETY: the SQE points into the piece's bounce buffer or the
            // op's HostMemory; the piece (with its bounce buffer) sits in
            // `slots[slot]` and its part's OpState (owning the memory) in
            // `parts` until this CQE is reaped; the fd belongs to the op's
            // IoFile, held by the same OpState.
            let ok = unsafe { self.ring.submission().push(&entry) }.is_ok();
            if !ok {
                self.free_slots.push(slot);
                self.queue.push_front(piece);
                let _ = self.ring.submit();
                break;
            }
            self.slots[slot] = Some(piece);
            self.in_flight += 1;
            pushed_any = true;
            if self.single_submit {
                let _ = self.ring.submit();
            }
        }
        if pushed_any && !self.single_submit {
            let _ = self.ring.submit();
        }
    }

    fn reap(&mut self) {
        let done: Vec<(usize, i64)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result() as i64))
            .collect();
        for (slot, raw) in done {
            let Some(mut piece) = self.slots.get_mut(slot).and_then(Option::take) else {
                tracing::error!(slot, "completion for an unknown file I/O slot");
                continue;
            };
            self.free_slots.push(slot);
            self.in_flight -= 1;
            let Some(op) = self.parts[piece.part].as_ref().map(|p| p.part.op.clone()) else {
                continue;
            };
            match self.shared.check(&op, &mut piece, raw) {
                Outcome::Done => {
                    if op.op == IoOp::Read && piece.way == Way::Bounce {
                        bounce_copy(&op, &mut piece, false);
                    }
                    piece.bounce = None;
                    self.piece_done(piece, None);
                }
                Outcome::Again => self.queue.push_front(piece),
                Outcome::Failed(e) => self.piece_done(piece, Some(e)),
            }
        }
    }

    fn piece_done(&mut self, piece: PieceTask, error: Option<SwapError>) {
        let idx = piece.part;
        drop(piece);
        let Some(ps) = self.parts[idx].as_mut() else {
            return;
        };
        if ps.error.is_none() {
            ps.error = error;
        }
        ps.pending = ps.pending.saturating_sub(1);
        if ps.pending == 0 {
            self.finish_part(idx);
        }
    }

    fn finish_part(&mut self, idx: usize) {
        if let Some(ps) = self.parts[idx].take() {
            self.free_parts.push(idx);
            self.shared.part_done(&ps.part.op, ps.error);
        }
    }
}

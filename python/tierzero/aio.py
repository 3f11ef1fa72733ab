"""``aio_handle``: DeepSpeed's DeepNVMe handle, on io_uring.

A drop-in for ``deepspeed.ops.op_builder.AsyncIOBuilder().load()``: the same
module-level functions (``aio_read``, ``aio_write``, ``deepspeed_memcpy``)
and the same ``aio_handle`` class, constructor, getters and methods, with
the same return values on success:

- ``read`` / ``write`` return 0;
- ``sync_pread`` / ``sync_pwrite``, and ``pread`` / ``pwrite`` with
  ``async=False``, return the number of ops completed (1, plus any async
  ops still pending, which a synchronous op waits for as in DeepSpeed);
- ``async_pread`` / ``async_pwrite`` return 0, and ``wait()`` returns the
  number of ops it completed.

Where we deliberately differ from DeepSpeed:

- **Errors raise** ``tierzero.AioError``, an ``OSError`` subclass with
  ``errno``, ``strerror``, ``filename``, ``offset`` and ``length``, instead
  of returning -1 (or failing an ``assert``). An async op's error is raised
  by ``wait()``, after every pending op has finished.
- **A failed write poisons the handle**: every later op raises at once
  (``AioError`` naming the first failure), so nothing reads what a failed
  write left behind. DeepSpeed's handle goes on after a failed op; this
  one never does: create a new ``aio_handle`` (after fixing the cause, and
  write again what the failed write was writing). The failed write's
  error and every refusal after it say so.
- **Any size and offset works.** Whole blocks go through O_DIRECT; memory
  that is not 4096-aligned goes through pinned bounce buffers; partial
  blocks at the ends of an unaligned range go through the page cache. No
  divisibility by ``intra_op_parallelism`` is needed (DeepSpeed returns -1).
  ``get_alignment()`` is ``intra_op_parallelism × 4096`` (DeepSpeed: × 512):
  the multiple at which every thread's share is whole blocks.
- **A read past the end of the file raises** (``errno.EINVAL``) before
  anything is submitted. ``read()`` reads ``buffer.nbytes`` bytes at
  ``file_offset`` like ``pread`` (DeepSpeed asserts the file size equals
  the tensor's).
- **Nothing is printed**: no timings, no "consumer SSD" warnings.
- ``validate=True`` compares the file's bytes with the tensor's after the
  op and raises ``AioError`` on a mismatch (DeepSpeed prints).
- ``free_cpu_locked_tensor`` unlocks and forgets the tensor; its memory is
  returned when the last reference to the tensor goes, so a tensor still in
  use can never dangle.

An op owns its tensor until it completes: do not read, write or resize
(``resize_``, ``set_``, which may free its storage) a tensor between
submitting an async op on it and ``wait()``. (DeepSpeed copies an
unpinned tensor at an async write's submission; tierzero reads it as the
op runs, so a change before ``wait()`` may reach the file.) A tensor
dropped before ``wait()`` is kept alive by the op; its bytes still land.

A handle may be shared by threads: as DeepSpeed's handle mutex, one lock
covers each call from submission to its wait, so a sync op returns once
its own op (and every one pending before it) has landed.

Extras: ``backend="auto" | "uring" | "portable"`` picks io_uring rings or
``pread``/``pwrite`` threads; ``get_backend()`` says which is in use;
``counters()`` says how many bytes went direct, through bounce buffers and
through the page cache. The GIL is released while files are opened, ops
submitted and ops waited for.
"""

from __future__ import annotations

import mmap
import operator
import os
import sys
import threading
import weakref
import errno as _errno

from ._native import AioError, _AioHandle, mlock as _mlock, munlock as _munlock

__all__ = ["aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "AioError"]

_PAGE = mmap.PAGESIZE
_HOST_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost


# Page-locked tensors made by new_cpu_locked_tensor: data_ptr -> locked bytes.
_LOCKED: dict[int, int] = {}


def _forget(base: int, n: int) -> None:
    """Drops a dead locked region (unless it was freed and reused since)."""
    if _LOCKED.get(base) == n:
        del _LOCKED[base]


def _locked_mapping(nbytes: int) -> mmap.mmap:
    """Anonymous memory for a locked tensor: private (``MAP_SHARED``
    anonymous memory is shmem, whose pages the kernel handles more slowly
    under direct I/O) and advised to transparent huge pages, so that a
    1 MiB transfer spans one or two folios instead of 256 pages: in
    ``scripts/compare_deepspeed_aio.py`` this cut the CPU time per GB of
    locked reads and writes about 5x (see docs/decisions/python-package.md).
    The advice is best effort (THP off or ``never``: ordinary pages)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:
            pass
    return region


_POISONED = (
    "this aio_handle refuses every op after a failed write (DeepSpeed's goes on): create a new "
    "aio_handle, and write again what the failed write was writing (its bytes on disk are unknown)"
)


def _is_torch(t) -> bool:
    # Any torch.Tensor, subclasses from other modules included (a
    # Parameter, a DTensor or a tensor subclass of a user's); numpy arrays
    # and the buffer protocol otherwise.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes at `offset` of `fd`, as many reads as it takes (one
    `pread` returns at most about 2 GiB on Linux, and may return fewer);
    fewer only at the end of the file. An fd opened write-only cannot be
    read: that is an AioError naming the fd and what to pass instead."""
    parts, got = [], 0
    while got < n:
        try:
            part = os.pread(fd, min(n - got, 1 << 30), offset + got)
        except OSError as e:
            if e.errno == _errno.EBADF:
                msg = f"validate reads the file back, and fd {fd} cannot be read ({e.strerror}); open it O_RDWR, or pass the file's path"
            else:
                msg = f"validate could not read the file back: {e.strerror}"
            raise AioError(e.errno or _errno.EIO, msg, f"<fd {fd}>") from e
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _nbytes(t) -> int:
    return int(t.nbytes)


def _bytes_of(t) -> bytes:
    """The tensor's bytes (for validate)."""
    if _is_torch(t):
        import torch

        flat = t.detach().reshape(-1)
        if flat.numel() == 0:
            return b""
        return flat.view(torch.uint8).cpu().numpy().tobytes()
    return bytes(memoryview(t).cast("B"))


def _locked_region(t) -> bool:
    if not _is_torch(t) or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + _nbytes(t)
    for base, n in list(_LOCKED.items()):
        if base <= start and end <= base + n:
            return True
    return False


class _Op:
    """What a pending op still has to do at ``wait()``."""

    __slots__ = ("copy_back", "validate")

    def __init__(self, copy_back=None, validate=None):
        self.copy_back = copy_back  # (device tensor, host tensor) after a read
        self.validate = validate  # (is_read, host tensor, target, file_offset)


def _whole(name, v) -> int:
    """``v`` as an int, as DeepSpeed's binding takes it: a float or a
    string is a ``TypeError`` (``int()`` truncated 4.9 to 4 and read
    ``"4"``), a bool too."""
    if isinstance(v, bool):
        raise TypeError(f"{name}: expected an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(v).__name__} {v!r}") from None


def _async_args(name, rest, kw):
    """``(async, file_offset)`` from DeepSpeed's positional ``async``."""
    if len(rest) > 2:
        raise TypeError(f"{name}() takes at most 5 positional arguments")
    async_op = rest[0] if len(rest) >= 1 else kw.pop("async", None)
    if async_op is None:
        async_op = kw.pop("async_op", None)
    if async_op is None:
        raise TypeError(f"{name}() missing required argument 'async'")
    file_offset = rest[1] if len(rest) == 2 else kw.pop("file_offset", 0)
    if kw:
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(kw)}")
    return bool(async_op), _whole("file_offset", file_offset)


class aio_handle:
    """DeepSpeed's ``aio_handle``, on io_uring (see the module docs)."""

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        backend: str = "auto",
        _faults=None,
    ):
        self._block_size = _whole("block_size", block_size)
        self._queue_depth = _whole("queue_depth", queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra_op_parallelism = _whole("intra_op_parallelism", intra_op_parallelism)
        self._h = _AioHandle(
            # Pieces of more than 64 MiB are cut by the native side
            # (tierzero_swap::fileio::MAX_PIECE_BYTES); get_block_size()
            # still says what the caller asked for.
            self._block_size,
            self._queue_depth,
            self._single_submit,
            self._overlap_events,
            self._intra_op_parallelism,
            backend,
            _faults,
        )
        self._ops: list[_Op] = []
        # One op at a time, submission to wait, as DeepSpeed's handle
        # mutex: the native wait takes every pending op, so a sync op of
        # another thread could take this one's and return before it landed.
        self._lock = threading.RLock()

    # Getters, as DeepSpeed's.
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    def get_alignment(self) -> int:
        return self._h.alignment()

    # Extras.
    def get_backend(self) -> str:
        return self._h.backend()

    def counters(self) -> dict:
        return self._h.counters()

    def is_poisoned(self) -> bool:
        return self._h.poisoned()

    def _say_poisoned(self, e: AioError) -> None:
        """Adds to ``e``, raised by a handle that a failed write has
        poisoned (the failed write's own error, or a later op's refusal,
        which the native side words as its swap space's), that the handle
        is done and a new one is the way on."""
        if self._h.poisoned() and _POISONED not in (e.strerror or ""):
            said = (e.strerror or "").replace("swap space is poisoned", "this aio_handle is poisoned", 1)
            e.strerror = f"{said}; {_POISONED}"
            e.args = (e.errno, e.strerror)

    # Submission.
    def _host(self, buffer, reading: bool):
        """A contiguous host tensor for the op, and the copy to do after it."""
        dev = buffer.__dlpack_device__()[0] if hasattr(buffer, "__dlpack_device__") else None
        if _is_torch(buffer):
            if dev in _HOST_DEVICES and buffer.is_contiguous():
                # detach(): the same memory, without autograd (torch refuses
                # to export a tensor that requires grad, an nn.Parameter).
                return buffer.detach(), None
            import torch

            if reading:
                host = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                return host, (buffer, host)
            return buffer.detach().to("cpu").contiguous(), None
        return buffer, None

    def _submit(self, is_read, buffer, target, validate, file_offset):
        # A bool is an int to Python: True wrote the buffer to fd 1.
        if isinstance(target, bool):
            raise TypeError(f"{target!r} is neither a filename nor an fd")
        file_offset = _whole("file_offset", file_offset)
        if isinstance(target, (bytes, bytearray)):
            target = os.fsdecode(target)
        host, copy_back = self._host(buffer, is_read)
        try:
            self._h.submit("read" if is_read else "write", host, target, file_offset)
        except AioError as e:
            self._say_poisoned(e)
            raise
        v = (is_read, host, target, file_offset) if validate else None
        self._ops.append(_Op(copy_back, v))

    def _wait_all(self) -> int:
        ops, self._ops = self._ops, []
        try:
            n = self._h.wait()
        except AioError as e:
            self._say_poisoned(e)
            raise
        finally:
            # Copy back every read that landed, even if another op failed.
            for op in ops:
                if op.copy_back is not None:
                    dst, src = op.copy_back
                    dst.copy_(src)
        for op in ops:
            if op.validate is not None:
                self._check(*op.validate)
        return n

    def _check(self, is_read, host, target, file_offset):
        n = _nbytes(host)
        if isinstance(target, int):
            data = _pread_all(target, n, file_offset)
            name = f"<fd {target}>"
        else:
            with open(target, "rb") as f:
                f.seek(file_offset)
                data = f.read(n)
            name = os.fspath(target)
        if data != _bytes_of(host):
            what = "read" if is_read else "write"
            err = AioError(_errno.EIO, f"validation of the {what} of {n} bytes at offset {file_offset} failed: the file's bytes differ from the tensor's", name)
            err.offset, err.length = file_offset, n
            raise err

    def read(self, buffer, filename, validate, file_offset=0) -> int:
        with self._lock:
            self._submit(True, buffer, filename, validate, file_offset)
            self._wait_all()
            return 0

    def write(self, buffer, filename, validate, file_offset=0) -> int:
        with self._lock:
            self._submit(False, buffer, filename, validate, file_offset)
            self._wait_all()
            return 0

    def pread(self, buffer, filename, validate, *rest, **kw) -> int:
        with self._lock:
            async_op, file_offset = _async_args("pread", rest, kw)
            self._submit(True, buffer, filename, validate, file_offset)
            return 0 if async_op else self._wait_all()

    def pwrite(self, buffer, filename, validate, *rest, **kw) -> int:
        with self._lock:
            async_op, file_offset = _async_args("pwrite", rest, kw)
            self._submit(False, buffer, filename, validate, file_offset)
            return 0 if async_op else self._wait_all()

    def sync_pread(self, buffer, filename, file_offset=0) -> int:
        with self._lock:
            self._submit(True, buffer, filename, False, file_offset)
            return self._wait_all()

    def sync_pwrite(self, buffer, filename, file_offset=0) -> int:
        with self._lock:
            self._submit(False, buffer, filename, False, file_offset)
            return self._wait_all()

    def async_pread(self, buffer, filename, file_offset=0) -> int:
        with self._lock:
            self._submit(True, buffer, filename, False, file_offset)
            return 0

    def async_pwrite(self, buffer, filename=None, file_offset=0, *, fd=None) -> int:
        """``filename`` may be a path or an open file descriptor; DeepSpeed's
        fd overload names it ``fd`` (``async_pwrite(buffer, fd=fd)``)."""
        with self._lock:
            if (filename is None) == (fd is None):
                raise TypeError("async_pwrite() takes a filename or an fd (exactly one)")
            if isinstance(fd, bool):
                raise TypeError(f"fd={fd!r} is not a file descriptor")
            self._submit(False, buffer, filename if fd is None else int(fd), False, file_offset)
            return 0

    def wait(self) -> int:
        """Waits for every pending op; returns how many completed."""
        with self._lock:
            if not self._ops and self._h.pending() == 0:
                return 0
            return self._wait_all()

    # Locked tensors.
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A page-aligned, page-locked CPU tensor of ``num_elem`` elements of
        ``example_tensor``'s dtype, in private memory advised to huge pages
        (``_locked_mapping``): ops on it go straight to the disk."""
        import torch

        num_elem = int(num_elem)
        if num_elem < 0:
            raise ValueError(f"num_elem must be >= 0, got {num_elem}")
        dtype = example_tensor.dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = num_elem * itemsize
        region = _locked_mapping(max(_PAGE, -(-nbytes // _PAGE) * _PAGE))
        if num_elem == 0:
            return torch.empty(0, dtype=dtype)
        t = torch.frombuffer(region, dtype=dtype, count=num_elem)
        locked = -(-nbytes // _PAGE) * _PAGE
        base = t.data_ptr()
        _mlock(base, locked)  # best effort: usable either way
        _LOCKED[base] = locked
        # The region lives as long as the tensor's storage (every view holds
        # it); when it goes, so does the mapping and its lock: forget the
        # range, or a later tensor at the same address would pass for locked.
        weakref.finalize(region, _forget, base, locked)
        return t

    def free_cpu_locked_tensor(self, tensor) -> bool:
        n = _LOCKED.pop(tensor.data_ptr(), None) if _is_torch(tensor) else None
        if n is None:
            return False
        _munlock(tensor.data_ptr(), n)
        return True

    def is_pinned(self, buffer) -> bool:
        """Torch-pinned, or locked by ``new_cpu_locked_tensor``."""
        if _is_torch(buffer):
            try:
                if buffer.is_pinned():
                    return True
            except RuntimeError:
                pass
        return _locked_region(buffer)


def aio_read(buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate) -> int:
    """DeepSpeed's one-shot read; returns 0."""
    h = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    return h.read(buffer, filename, validate)


def aio_write(buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate) -> int:
    """DeepSpeed's one-shot write; returns 0."""
    h = aio_handle(block_size, queue_depth, single_submit, overlap_events, 1)
    return h.write(buffer, filename, validate)


def deepspeed_memcpy(dest, src) -> int:
    """DeepSpeed's ``deepspeed_memcpy``: ``dest.copy_(src)``; returns 0."""
    dest.copy_(src)
    return 0

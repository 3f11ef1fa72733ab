"""Parity suite for ``tierzero.aio.aio_handle`` (DeepSpeed's DeepNVMe handle).

Every op is checked byte for byte against the file's contents as plain
Python reads them (and every read against bytes plain Python wrote), over
both backends, 1 and 2 workers, every submit mode, locked / plain torch /
numpy tensors, awkward sizes and offsets, a file system without O_DIRECT,
errors (real and injected through the native handle's test-only
``_faults``), and the lifetime of tensors dropped before ``wait()``.
"""

from __future__ import annotations

import errno
import gc
import mmap
import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tierzero  # noqa: E402
from tierzero import AioError, aio  # noqa: E402

PAGE = mmap.PAGESIZE
BACKENDS = ["uring", "portable"]
KINDS = ["locked", "torch", "torch_unaligned", "numpy"]
DTYPES = {
    "float32": (torch.float32, np.float32),
    "bfloat16": (torch.bfloat16, None),
    "uint8": (torch.uint8, np.uint8),
}
ODD_SIZES = [0, 1, 4095, 4097, (1 << 20) + 3]
ODD_OFFSETS = [0, 1, 4096, 12345]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def rand_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def put_file(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def handle(backend="uring", intra=1, block=1 << 20, qd=128, single=False, overlap=False, faults=None):
    h = aio.aio_handle(block, qd, single, overlap, intra, backend=backend, _faults=faults)
    assert h.get_backend() == backend
    return h


def make_tensor(kind: str, dtype: str, numel: int, h):
    """An empty tensor of ``kind`` (not zeroed on purpose: reads must fill it)."""
    tdt, ndt = DTYPES[dtype]
    if kind == "locked":
        return h.new_cpu_locked_tensor(numel, torch.empty(0, dtype=tdt))
    if kind == "torch":
        return torch.empty(numel, dtype=tdt)
    if kind == "torch_unaligned":
        # A contiguous view starting one element in: an odd address.
        return torch.empty(numel + 1, dtype=tdt)[1:]
    if kind == "numpy":
        if ndt is None:
            pytest.skip("numpy has no bfloat16")
        return np.empty(numel, dtype=ndt)
    raise AssertionError(kind)


def tensor_bytes(t) -> bytes:
    if isinstance(t, np.ndarray):
        return t.tobytes()
    if t.numel() == 0:
        return b""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fill(t, data: bytes):
    """Sets ``t``'s bytes to ``data`` (len(data) == t.nbytes)."""
    assert len(data) == t.nbytes
    if len(data) == 0:
        return t
    src = np.frombuffer(data, dtype=np.uint8)
    if isinstance(t, np.ndarray):
        t.reshape(-1).view(np.uint8)[:] = src
    else:
        t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(src.copy()))
    return t


def tensor_with(kind, dtype, data: bytes, h):
    itemsize = torch.empty((), dtype=DTYPES[dtype][0]).element_size()
    assert len(data) % itemsize == 0
    return fill(make_tensor(kind, dtype, len(data) // itemsize, h), data)


def odirect_ok(directory) -> bool:
    path = os.path.join(directory, ".odirect_probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(path)
    return True


@pytest.fixture
def d(tmp_path):
    return str(tmp_path)


@pytest.fixture
def direct_dir(tmp_path):
    if not odirect_ok(str(tmp_path)):
        why = f"{tmp_path} has no O_DIRECT"
        # CI sets it where O_DIRECT works: the direct path must run there,
        # not skip (as the Rust tests' direct paths fail under it).
        if os.environ.get("TIERZERO_REQUIRE_DIRECT_IO") == "1":
            pytest.fail("TIERZERO_REQUIRE_DIRECT_IO=1, but " + why)
        pytest.skip(why)
    return str(tmp_path)


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as t:
        yield t


# --------------------------------------------------------------------------
# Constructor and getters
# --------------------------------------------------------------------------


def test_constructor_defaults_and_getters():
    h = aio.aio_handle()
    assert h.get_block_size() == 1048576
    assert h.get_queue_depth() == 128
    assert h.get_single_submit() is False
    assert h.get_overlap_events() is False
    assert h.get_intra_op_parallelism() == 1
    assert h.get_alignment() == 4096
    assert h.get_backend() in ("uring", "portable")
    assert aio.aio_handle(backend="auto").get_backend() in ("uring", "portable")


@pytest.mark.parametrize("backend", BACKENDS)
def test_constructor_positional_and_keywords(backend):
    h = aio.aio_handle(65536, 8, True, True, 2, backend=backend)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (65536, 8, True, True, 2, 2 * 4096)
    h = aio.aio_handle(block_size=4096, queue_depth=1, single_submit=False, overlap_events=True,
                       intra_op_parallelism=3, backend=backend)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (4096, 1, False, True, 3, 3 * 4096)
    assert h.get_backend() == backend


# (A queue depth over a ring's 4096 was an AioError with errno EIO.)
@pytest.mark.parametrize("kw", [{"block_size": 0}, {"queue_depth": 0}, {"intra_op_parallelism": 0},
                                {"block_size": -1}, {"backend": "libaio"}, {"queue_depth": 5000}])
def test_constructor_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        aio.aio_handle(**kw)


@pytest.mark.parametrize("kw", [{"block_size": 1.5e6}, {"queue_depth": "8"}, {"intra_op_parallelism": True}])
def test_constructor_takes_integers_only(kw):
    # As DeepSpeed's binding: int() read 1.5e6 and "8" without a word.
    with pytest.raises(TypeError, match="expected an integer"):
        aio.aio_handle(**kw)


def test_a_file_offset_that_is_not_an_integer_is_refused(d):
    # 4.9 was truncated to 4, "4" read as 4.
    h = handle("portable")
    t = tensor_with("torch", "uint8", b"x" * 4096, h)
    p = os.path.join(d, "f")
    for off in (4.9, "4"):
        with pytest.raises(TypeError, match="file_offset: expected an integer"):
            h.sync_pwrite(t, p, off)
    with pytest.raises(TypeError, match="file_offset"):
        h.pwrite(t, p, False, True, 2.0)
    assert h.wait() == 0


def test_package_surface():
    assert issubclass(AioError, OSError)
    assert tierzero.AioError is AioError
    assert aio.AioError is AioError
    for name in ("aio_handle", "aio_read", "aio_write", "deepspeed_memcpy"):
        assert callable(getattr(aio, name))


# --------------------------------------------------------------------------
# Every method: return values and bytes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [False, True])
def test_read_write(d, backend, validate):
    h = handle(backend)
    data = rand_bytes(3 * 4096 + 17, 1)
    p = os.path.join(d, "f")
    t = tensor_with("torch", "uint8", data, h)
    assert h.write(t, p, validate) == 0
    assert file_bytes(p) == data
    u = make_tensor("torch", "uint8", len(data), h)
    assert h.read(u, p, validate) == 0
    assert tensor_bytes(u) == data
    # file_offset (keyword and positional), as DeepSpeed's binding allows.
    assert h.write(t, p, validate, file_offset=5) == 0
    assert file_bytes(p) == data[:5] + data
    assert h.read(u, p, validate, 5) == 0
    assert tensor_bytes(u) == data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_read", [False, True])
def test_validate_fails_when_the_bytes_differ(d, backend, is_read, monkeypatch):
    # Nothing else makes the file and the tensor differ after a transfer
    # that succeeded: the tensor's bytes, as validate sees them, are
    # altered by one bit, and the transfer must fail with EIO, its offset
    # and length.
    import tierzero.aio as aio_module

    h = handle(backend)
    data = rand_bytes(2 * 4096 + 3, 2)
    p = os.path.join(d, "f")
    t = tensor_with("torch", "uint8", data, h)
    assert h.write(t, p, True) == 0
    real = aio_module._bytes_of

    def flipped(t):
        b = bytearray(real(t))
        b[4096] ^= 1
        return bytes(b)

    monkeypatch.setattr(aio_module, "_bytes_of", flipped)
    u = make_tensor("torch", "uint8", len(data), h)
    offset = 0 if is_read else 7
    with pytest.raises(AioError) as e:
        if is_read:
            h.read(u, p, True, offset)
        else:
            h.write(t, p, True, offset)
    assert e.value.errno == errno.EIO and "differ" in str(e.value)
    assert (e.value.offset, e.value.length) == (offset, len(data))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", [False, True])
def test_pread_pwrite_positional_async_and_offset(d, backend, validate):
    h = handle(backend)
    data = rand_bytes(8192 + 100, 2)
    p = os.path.join(d, "f")
    t = tensor_with("locked", "uint8", data, h)
    # sync, positional async=False, file_offset positional
    assert h.pwrite(t, p, validate, False, 4096) == 1
    got = file_bytes(p)
    assert len(got) == 4096 + len(data) and got[4096:] == data and got[:4096] == bytes(4096)
    u = make_tensor("locked", "uint8", len(data), h)
    assert h.pread(u, p, validate, False, 4096) == 1
    assert tensor_bytes(u) == data
    # async=True positional, then wait
    data2 = rand_bytes(len(data), 3)
    t2 = tensor_with("torch", "uint8", data2, h)
    assert h.pwrite(t2, p, validate, True, 1) == 0
    assert h.wait() == 1
    assert file_bytes(p)[1:1 + len(data2)] == data2
    u2 = make_tensor("torch", "uint8", len(data2), h)
    assert h.pread(u2, p, validate, True, 1) == 0
    assert h.wait() == 1
    assert tensor_bytes(u2) == data2
    # file_offset as keyword, async positional
    assert h.pread(u2, p, validate, False, file_offset=1) == 1
    assert tensor_bytes(u2) == data2


@pytest.mark.parametrize("backend", BACKENDS)
def test_pread_pwrite_async_keyword(d, backend):
    h = handle(backend)
    data = rand_bytes(5000, 4)
    p = os.path.join(d, "f")
    t = tensor_with("torch", "uint8", data, h)
    assert h.pwrite(t, p, False, **{"async": True}) == 0
    assert h.wait() == 1
    assert file_bytes(p) == data
    assert h.pwrite(t, p, False, **{"async": False, "file_offset": 10}) == 1
    assert file_bytes(p) == data[:10] + data
    u = make_tensor("numpy", "uint8", len(data), h)
    assert h.pread(u, p, False, **{"async": True, "file_offset": 10}) == 0
    assert h.wait() == 1
    assert tensor_bytes(u) == data
    assert h.pread(u, p, True, **{"async": False}) == 1
    assert tensor_bytes(u) == (data[:10] + data)[: len(data)]
    with pytest.raises(TypeError):
        h.pread(u, p, False)  # async is required, as in DeepSpeed
    with pytest.raises(TypeError):
        h.pread(u, p, False, True, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_pread_pwrite_counts(d, backend):
    h = handle(backend)
    data = [rand_bytes(4096 * (i + 1) + i, 10 + i) for i in range(3)]
    ps = [os.path.join(d, f"f{i}") for i in range(3)]
    ts = [tensor_with("torch", "uint8", x, h) for x in data]
    assert h.sync_pwrite(ts[0], ps[0]) == 1
    assert file_bytes(ps[0]) == data[0]
    # A sync op after 2 pending async ops completes all three.
    assert h.async_pwrite(ts[1], ps[1]) == 0
    assert h.async_pwrite(ts[2], ps[2]) == 0
    assert h.sync_pwrite(ts[0], ps[0], 4096) == 3
    assert h.wait() == 0
    assert file_bytes(ps[0]) == data[0][:4096] + data[0]
    assert file_bytes(ps[1]) == data[1]
    assert file_bytes(ps[2]) == data[2]
    us = [make_tensor("torch", "uint8", len(x), h) for x in data]
    assert h.sync_pread(us[0], ps[0]) == 1
    assert h.async_pread(us[1], ps[1]) == 0
    assert h.async_pread(us[2], ps[2]) == 0
    u0 = make_tensor("torch", "uint8", len(data[0]), h)
    assert h.sync_pread(u0, ps[0], 4096) == 3
    assert [tensor_bytes(u) for u in us] == data[:1] + data[1:]
    assert tensor_bytes(u0) == data[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 3])
def test_async_then_wait_counts(d, backend, n):
    h = handle(backend, block=65536, qd=4)
    data = [rand_bytes(70000 + 1000 * i, 20 + i) for i in range(n)]
    ps = [os.path.join(d, f"f{i}") for i in range(n)]
    ts = [tensor_with("torch", "uint8", x, h) for x in data]
    assert all(h.async_pwrite(t, p) == 0 for t, p in zip(ts, ps))
    assert h.wait() == n
    assert h.wait() == 0  # nothing pending
    assert [file_bytes(p) for p in ps] == data
    us = [make_tensor("locked", "uint8", len(x), h) for x in data]
    assert all(h.async_pread(u, p) == 0 for u, p in zip(us, ps))
    assert h.wait() == n
    assert [tensor_bytes(u) for u in us] == data


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_async_ops_small_queue(d, backend):
    h = handle(backend, block=4096, qd=2, intra=2)
    n = 24
    data = [rand_bytes(3000 * i + 1, 30 + i) for i in range(n)]
    p = os.path.join(d, "f")
    offs = np.cumsum([0] + [len(x) for x in data]).tolist()
    ts = [tensor_with("torch", "uint8", x, h) for x in data]
    for t, o in zip(ts, offs):
        assert h.async_pwrite(t, p, o) == 0
    assert h.wait() == n
    assert file_bytes(p) == b"".join(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_fd_transfers_only_as_it_was_opened(d, backend):
    # The fd is reopened through /proc for O_DIRECT: a read-only one was
    # written through (os.write on it gives EBADF).
    h = handle(backend)
    p = os.path.join(d, "f")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    t = tensor_with("torch", "uint8", rand_bytes(4096, 6), h)
    fd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(AioError) as e:
            h.sync_pwrite(t, fd)
        assert e.value.errno == errno.EBADF and "not open for writing" in str(e.value)
        assert h.sync_pread(t, fd) == 1
    finally:
        os.close(fd)
    assert file_bytes(p) == b"\0" * 4096


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bool_is_neither_a_filename_nor_an_fd(backend):
    # True is the int 1 to Python: the buffer was written to stdout.
    h = handle(backend)
    t = tensor_with("torch", "uint8", b"x" * 4096, h)
    with pytest.raises(TypeError, match="neither a filename nor an fd"):
        h.sync_pwrite(t, True)
    with pytest.raises(TypeError, match="not a file descriptor"):
        h.async_pwrite(t, fd=True)
    assert h.wait() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_by_fd(d, backend):
    h = handle(backend)
    data = rand_bytes(2 * 4096 + 333, 5)
    p = os.path.join(d, "f")
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        t = tensor_with("locked", "uint8", data, h)
        assert h.async_pwrite(t, fd) == 0
        assert h.async_pwrite(t, fd, len(data)) == 0
        assert h.wait() == 2
        # DeepSpeed's fd overload, by keyword.
        assert h.async_pwrite(t, fd=fd, file_offset=len(data)) == 0
        assert h.async_pwrite(buffer=t, fd=fd) == 0
        assert h.wait() == 2
        assert file_bytes(p) == data + data
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # the caller's offset is untouched
        assert h.sync_pwrite(t, fd, 7) == 1
        expect = bytearray(data + data)
        expect[7:7 + len(data)] = data
        assert file_bytes(p) == bytes(expect)
        u = make_tensor("torch", "uint8", len(data), h)
        assert h.sync_pread(u, fd, 7) == 1
        assert tensor_bytes(u) == data
        u = make_tensor("numpy", "uint8", len(data), h)
        assert h.async_pread(u, fd, len(data)) == 0
        assert h.wait() == 1
        assert tensor_bytes(u) == bytes(expect[len(data):])
        u = make_tensor("torch", "uint8", len(data), h)
        assert h.pread(u, fd, False, False, 0) == 1
        assert tensor_bytes(u) == bytes(expect[: len(data)])
        assert h.pwrite(t, fd, False, True, 2 * len(data)) == 0
        assert h.wait() == 1
        assert file_bytes(p) == bytes(expect) + data
        assert h.write(t, fd, False, 0) == 0
        assert h.read(u, fd, False) == 0
        assert tensor_bytes(u) == data
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["TemporaryFile", "unlinked"])
def test_ops_by_fd_of_unlinked_file(d, backend, how):
    h = handle(backend, intra=2)
    if how == "TemporaryFile":
        f = tempfile.TemporaryFile(dir=d)  # O_TMPFILE where the kernel has it
        fd = f.fileno()
    else:
        p = os.path.join(d, "gone")
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink(p)
    try:
        data = rand_bytes(3 * 8192 + 5, 11)
        t = tensor_with("locked", "uint8", data, h)
        assert h.async_pwrite(t, fd, 4096) == 0
        assert h.wait() == 1
        assert os.pread(fd, len(data) + 10, 4096) == data
        u = make_tensor("torch", "uint8", len(data), h)
        assert h.sync_pread(u, fd, 4096) == 1
        assert tensor_bytes(u) == data
    finally:
        if how == "TemporaryFile":
            f.close()
        else:
            os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_beyond_4gib(d, backend):
    h = handle(backend, intra=2)
    p = os.path.join(d, "sparse")
    data = rand_bytes(3 * 4096 + 7, 12)
    off = (1 << 33) + 12345
    t = tensor_with("torch", "uint8", data, h)
    assert h.sync_pwrite(t, p, off) == 1
    assert os.path.getsize(p) == off + len(data)
    with open(p, "rb") as f:
        f.seek(off - 1)
        assert f.read() == b"\0" + data
    u = make_tensor("locked", "uint8", len(data), h)
    assert h.sync_pread(u, p, off) == 1
    assert tensor_bytes(u) == data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [(1 << 30) + 4096, (1 << 31) - 1])
def test_large_block_size_with_unaligned_memory(d, backend, block):
    """DeepSpeed takes any block_size up to INT_MAX. Either refuse it at
    construction (ValueError), or serve ops with it."""
    try:
        h = handle(backend, block=block)
    except ValueError:
        return
    p = os.path.join(d, "f")
    data = rand_bytes(8192 + 3, 13)
    t = tensor_with("torch_unaligned", "uint8", data, h)
    assert h.sync_pwrite(t, p) == 1
    assert file_bytes(p) == data
    u = make_tensor("torch_unaligned", "uint8", len(data), h)
    assert h.sync_pread(u, p) == 1
    assert tensor_bytes(u) == data


def test_ops_by_path_like(d):
    import pathlib

    h = handle()
    data = rand_bytes(5000, 6)
    p = pathlib.Path(d) / "f"
    t = tensor_with("torch", "uint8", data, h)
    assert h.sync_pwrite(t, p) == 1
    assert h.sync_pwrite(t, os.fsencode(str(p)), 5000) == 1
    assert file_bytes(p) == data + data
    u = make_tensor("torch", "uint8", len(data), h)
    assert h.pread(u, p, True, False, 5000) == 1
    assert tensor_bytes(u) == data


def test_a_parameter_that_requires_grad_is_written_and_read(d):
    # DeepSpeed's handle takes an nn.Parameter (it goes by data_ptr);
    # torch refuses to export one through DLPack unless it is detached.
    h = handle()
    p = os.path.join(d, "param")
    w = torch.nn.Parameter(torch.arange(1024, dtype=torch.float32))
    assert h.sync_pwrite(w, p) == 1
    back = torch.nn.Parameter(torch.zeros(1024))
    assert h.sync_pread(back, p) == 1
    assert torch.equal(back.detach(), w.detach()) and back.requires_grad


def test_module_functions(d):
    data = rand_bytes(3 * 4096 + 5, 7)
    p = os.path.join(d, "f")
    t = tensor_with("torch", "uint8", data, None)
    assert aio.aio_write(t, p, 4096, 8, False, True, True) == 0
    assert file_bytes(p) == data
    u = make_tensor("torch", "uint8", len(data), None)
    assert aio.aio_read(u, p, 4096, 8, True, False, True) == 0
    assert tensor_bytes(u) == data
    v = torch.empty_like(u)
    assert aio.deepspeed_memcpy(v, u) == 0
    assert torch.equal(v, u)


# --------------------------------------------------------------------------
# Locked tensors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_new_cpu_locked_tensor(dtype):
    h = handle()
    tdt = DTYPES[dtype][0]
    for numel in (1, 1000, 4096, 12345):
        t = h.new_cpu_locked_tensor(numel, torch.ones(3, dtype=tdt))
        assert t.dtype == tdt
        assert t.device.type == "cpu"
        assert t.shape == (numel,)
        assert t.is_contiguous()
        assert t.data_ptr() % PAGE == 0
        assert h.is_pinned(t)
        if numel > 1:
            assert h.is_pinned(t[1:])  # a view inside the locked region
        t.fill_(1)  # usable memory
        assert h.free_cpu_locked_tensor(t) is True
        assert h.free_cpu_locked_tensor(t) is False
        assert not h.is_pinned(t)
    z = h.new_cpu_locked_tensor(0, torch.empty(0, dtype=tdt))
    assert z.numel() == 0 and z.dtype == tdt


def _vma_of(addr: int):
    """The /proc/self/smaps entry holding ``addr``: its header line's words
    and its fields."""
    import re

    header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = header.match(line)
            if m:
                if found is not None:
                    break
                if int(m.group(1), 16) <= addr < int(m.group(2), 16):
                    found = (line.split(), {})
            elif found is not None:
                key, _, value = line.partition(":")
                found[1][key] = value.strip()
    assert found is not None, f"no mapping holds {addr:#x}"
    return found


def test_locked_tensor_is_private_and_huge_page_advised():
    """Locked tensors are private anonymous memory (shared anonymous memory
    is shmem) advised to transparent huge pages (VmFlags ``hg``), which cut
    the CPU time of direct I/O about 5x (docs/decisions/python-package.md)."""
    h = handle()
    t = h.new_cpu_locked_tensor(8 << 20, torch.empty(0, dtype=torch.uint8))
    head, fields = _vma_of(t.data_ptr())
    perms = head[1]
    assert perms[3] == "p", f"locked tensor mapping is {perms}, not private"
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    if "[never]" not in thp:
        assert "hg" in fields.get("VmFlags", "").split(), fields.get("VmFlags")
    assert h.free_cpu_locked_tensor(t)


def test_free_and_is_pinned_of_other_tensors():
    h = handle()
    plain = torch.empty(1 << 16)
    assert h.free_cpu_locked_tensor(plain) is False
    assert not h.is_pinned(plain)
    assert not h.is_pinned(np.empty(10))
    t = h.new_cpu_locked_tensor(1 << 16, plain)
    # Freed through another handle: the lock manager is process-wide, as
    # DeepSpeed's shared pinned-tensor manager.
    assert handle("portable").free_cpu_locked_tensor(t) is True


def test_locked_tensor_dropped_without_free_forgets_its_range():
    """A locked tensor garbage-collected without free_cpu_locked_tensor must
    not leave its address range marked as locked: another tensor that gets
    the same address later is not pinned, and freeing it is not a success."""
    h = handle()
    nbytes = 1 << 20
    t = h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    ptr = t.data_ptr()
    del t
    gc.collect()
    keep = []
    for _ in range(64):
        m = mmap.mmap(-1, nbytes)
        u = torch.frombuffer(m, dtype=torch.uint8)
        if u.data_ptr() == ptr:
            assert not h.is_pinned(u), "a plain tensor at a dead locked tensor's address is reported pinned"
            assert h.free_cpu_locked_tensor(u) is False
            return
        keep.append(u)
    pytest.skip("the address was not reused")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
def test_locked_aligned_goes_direct(direct_dir, backend, intra):
    h = handle(backend, intra=intra)
    n = 4 * h.get_alignment() * 64  # whole blocks for every worker
    data = rand_bytes(n, 8)
    t = tensor_with("locked", "uint8", data, h)
    p = os.path.join(direct_dir, "f")
    c0 = h.counters()
    assert h.sync_pwrite(t, p) == 1
    c1 = h.counters()
    assert c1["direct"] - c0["direct"] == n
    assert c1["bounce"] == c0["bounce"]
    assert c1["buffered"] == c0["buffered"]
    u = h.new_cpu_locked_tensor(n, t)
    assert h.sync_pread(u, p) == 1
    c2 = h.counters()
    assert c2["direct"] - c1["direct"] == n
    assert c2["bounce"] == c0["bounce"]
    assert tensor_bytes(u) == data == file_bytes(p)
    # A plain torch tensor (64-byte aligned) bounces instead.
    v = tensor_with("torch_unaligned", "uint8", data, h)
    assert h.sync_pwrite(v, p) == 1
    assert h.counters()["bounce"] - c2["bounce"] == n
    assert file_bytes(p) == data


# --------------------------------------------------------------------------
# The matrix: backends, workers, tensor kinds, sizes, offsets, dtypes
# --------------------------------------------------------------------------


def roundtrip(h, kind, dtype, data: bytes, off: int, directory: str, tag: str):
    """Writes ``data`` at ``off`` (fresh file, then inside a larger file),
    reads it back, all checked against plain Python's view of the file."""
    fresh = os.path.join(directory, f"fresh-{tag}")
    t = tensor_with(kind, dtype, data, h)
    assert h.sync_pwrite(t, fresh, off) == 1
    got = file_bytes(fresh)
    if data:
        assert len(got) == off + len(data)
        assert got[:off] == bytes(off)
    assert got[off:] == data
    # Inside a file of other bytes: nothing around the range is touched.
    inner = os.path.join(directory, f"inner-{tag}")
    bg = rand_bytes(off + len(data) + 5000, len(data) + off)
    put_file(inner, bg)
    assert h.async_pwrite(t, inner, off) == 0
    assert h.wait() == 1
    assert file_bytes(inner) == bg[:off] + data + bg[off + len(data):]
    # Reads: from the middle of a file, and up to its very end.
    u = fill(make_tensor(kind, dtype, t.shape[0], h), bytes(len(data)))
    assert h.sync_pread(u, inner, off) == 1
    assert tensor_bytes(u) == data
    put_file(inner, bg[:off] + data)
    u = make_tensor(kind, dtype, t.shape[0], h)
    assert h.async_pread(u, inner, off) == 0
    assert h.wait() == 1
    assert tensor_bytes(u) == data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_awkward_sizes_and_offsets(d, backend, intra, kind):
    h = handle(backend, intra=intra)
    for size in ODD_SIZES:
        for off in ODD_OFFSETS:
            data = rand_bytes(size, size * 7 + off)
            roundtrip(h, kind, "uint8", data, off, d, f"{size}-{off}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtypes(d, backend, kind, dtype):
    h = handle(backend, intra=2, block=65536)
    itemsize = torch.empty((), dtype=DTYPES[dtype][0]).element_size()
    for numel in (1, 1023, 1025, 70001):
        for off in (0, 4096, 12345):
            data = rand_bytes(numel * itemsize, numel + off)
            roundtrip(h, kind, dtype, data, off, d, f"{numel}-{off}")
    # The tensor's values, not just its bytes, come back.
    src = torch.randn(5000).to(DTYPES[dtype][0])
    p = os.path.join(d, "values")
    assert h.sync_pwrite(src, p, 3) == 1
    dst = torch.empty_like(src)
    assert h.sync_pread(dst, p, 3) == 1
    assert torch.equal(dst, src)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("intra", [1, 2])
def test_submit_modes(d, backend, single, overlap, intra):
    h = handle(backend, intra=intra, block=65536, qd=4, single=single, overlap=overlap)
    assert (h.get_single_submit(), h.get_overlap_events()) == (single, overlap)
    for kind in ("locked", "torch_unaligned"):
        for size, off in ((20 * 65536 + 4097, 1), (16 * 65536, 0), (300000, 8192)):
            roundtrip(h, kind, "uint8", rand_bytes(size, size + off), off, d, f"{kind}-{size}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
@pytest.mark.parametrize("aligned", [False, True])
def test_file_offset_partitions(d, backend, intra, aligned):
    """Several tensors at consecutive offsets of one file (as DeepSpeed's
    swappers lay out partitions), read back one by one and as a whole."""
    h = handle(backend, intra=intra, block=65536, qd=8)
    sizes = [4096 * 3, 5000, 1, 8192, 12345, 65536 * 3 + 7, 4096]
    data = [rand_bytes(n, 40 + i) for i, n in enumerate(sizes)]
    offs, o = [], 0
    for n in sizes:
        offs.append(o)
        o += n
        if aligned:
            o = -(-o // 4096) * 4096
    p = os.path.join(d, "parts")
    kinds = ["locked", "torch", "numpy", "torch_unaligned"]
    ts = [tensor_with(kinds[i % 4], "uint8", x, h) for i, x in enumerate(data)]
    for t, off in zip(ts, offs):
        assert h.async_pwrite(t, p, off) == 0
    assert h.wait() == len(ts)
    whole = file_bytes(p)
    assert len(whole) == offs[-1] + sizes[-1]
    expect = bytearray(len(whole))
    for x, off in zip(data, offs):
        expect[off:off + len(x)] = x
    assert whole == bytes(expect)
    us = [make_tensor(kinds[(i + 1) % 4], "uint8", n, h) for i, n in enumerate(sizes)]
    for u, off in zip(us, offs):
        assert h.async_pread(u, p, off) == 0
    assert h.wait() == len(us)
    assert [tensor_bytes(u) for u in us] == data
    big = make_tensor("locked", "uint8", len(whole), h)
    assert h.sync_pread(big, p) == 1
    assert tensor_bytes(big) == whole
    # And the whole file written at once, read back in partitions.
    big2 = tensor_with("torch", "uint8", rand_bytes(len(whole), 99), h)
    assert h.sync_pwrite(big2, p) == 1
    for u, off, n in zip(us, offs, sizes):
        assert h.sync_pread(u, p, off) == 1
        assert tensor_bytes(u) == tensor_bytes(big2)[off:off + n]


def test_multidimensional_and_noncontiguous(d):
    h = handle(intra=2)
    p = os.path.join(d, "f")
    a = torch.randn(64, 129)
    assert h.sync_pwrite(a, p) == 1
    assert file_bytes(p) == tensor_bytes(a)
    # A non-contiguous tensor is written as its contiguous copy would be...
    at = a.t()
    assert h.sync_pwrite(at, p, 4) == 1
    assert file_bytes(p)[4:] == at.contiguous().numpy().tobytes()
    # ... and read into in place.
    b = torch.zeros(64, 129).t()
    assert b.shape == at.shape
    assert not b.is_contiguous()
    assert h.sync_pread(b, p, 4) == 1
    assert torch.equal(b, at)
    # numpy 2-D
    n = np.arange(35 * 17, dtype=np.float32).reshape(35, 17)
    assert h.sync_pwrite(n, p) == 1
    m = np.empty_like(n)
    assert h.sync_pread(m, p) == 1
    assert np.array_equal(m, n)


def test_read_only_numpy_cannot_be_read_into(d):
    h = handle()
    p = os.path.join(d, "f")
    put_file(p, rand_bytes(100, 1))
    a = np.zeros(100, dtype=np.uint8)
    a.flags.writeable = False
    assert h.sync_pwrite(a, p) == 1  # writing from it is fine
    with pytest.raises((ValueError, BufferError, TypeError)):
        h.sync_pread(a, p)
    assert h.wait() == 0


# --------------------------------------------------------------------------
# A file system without O_DIRECT
# --------------------------------------------------------------------------


def tmpfs_cases(h, directory):
    for kind in ("locked", "torch", "numpy"):
        for size in (1, 4096, 65536 * 3 + 5):
            for off in (0, 12345):
                roundtrip(h, kind, "uint8", rand_bytes(size, size + off), off, directory, f"{kind}{size}-{off}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
def test_tmpfs(shm_dir, backend, intra):
    """/dev/shm, whether or not its kernel lets tmpfs take O_DIRECT (6.6+ does)."""
    h = handle(backend, intra=intra, block=65536)
    tmpfs_cases(h, shm_dir)
    if not odirect_ok(shm_dir):
        c = h.counters()
        assert c["direct"] == 0 and c["bounce"] == 0 and c["buffered"] > 0


@pytest.fixture
def no_odirect_dir():
    """A directory whose file system refuses O_DIRECT: $TIERZERO_TEST_NO_ODIRECT_DIR
    (e.g. a ramfs mount), else /dev/shm on kernels before 6.6; else skip."""
    for cand in (os.environ.get("TIERZERO_TEST_NO_ODIRECT_DIR"), "/dev/shm"):
        if cand and os.path.isdir(cand) and not odirect_ok(cand):
            with tempfile.TemporaryDirectory(dir=cand) as t:
                yield t
            return
    why = ("no file system without O_DIRECT here (tmpfs takes O_DIRECT on Linux >= 6.6; "
           "set TIERZERO_TEST_NO_ODIRECT_DIR to e.g. a ramfs mount)")
    # CI mounts one and requires it: the page-cache path must run there.
    if os.environ.get("TIERZERO_REQUIRE_NO_ODIRECT") == "1":
        pytest.fail("TIERZERO_REQUIRE_NO_ODIRECT=1, but " + why)
    pytest.skip(why)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
def test_file_system_without_odirect(no_odirect_dir, backend, intra):
    h = handle(backend, intra=intra, block=65536)
    tmpfs_cases(h, no_odirect_dir)
    c = h.counters()
    assert c["direct"] == 0 and c["bounce"] == 0 and c["buffered"] > 0
    t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.uint8))
    b0 = h.counters()["buffered"]
    assert h.sync_pwrite(t, os.path.join(no_odirect_dir, "x")) == 1
    assert h.counters()["buffered"] - b0 == 1 << 20
    assert h.counters()["direct"] == 0


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_past_eof(d, backend):
    h = handle(backend)
    p = os.path.join(d, "short")
    put_file(p, rand_bytes(1000, 1))
    u = torch.empty(1000, dtype=torch.uint8)
    for call in (lambda: h.sync_pread(u, p, 10), lambda: h.async_pread(u, p, 10),
                 lambda: h.pread(u, p, False, True, 10), lambda: h.read(u, p, False, 1)):
        with pytest.raises(AioError) as ei:
            call()
        e = ei.value
        assert isinstance(e, OSError)
        assert e.errno == errno.EINVAL
        assert e.filename == p
        assert e.offset in (10, 1)
        assert e.length == 1000
    assert h.wait() == 0  # refused before submission: nothing pending
    assert not h.is_poisoned()
    # Up to the end is fine, past it by one byte is not.
    assert h.sync_pread(u[:990], p, 10) == 1
    with pytest.raises(AioError) as ei:
        h.sync_pread(u[:991], p, 10)
    assert (ei.value.errno, ei.value.offset, ei.value.length) == (errno.EINVAL, 10, 991)
    with pytest.raises(AioError) as ei:
        h.sync_pread(u[:0], p, 1001)
    assert ei.value.errno == errno.EINVAL


def test_missing_file(d):
    h = handle()
    p = os.path.join(d, "nope")
    with pytest.raises(AioError) as ei:
        h.sync_pread(torch.empty(10), p)
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == p
    with pytest.raises(AioError) as ei:
        h.sync_pwrite(torch.empty(10), os.path.join(d, "no", "dir"))
    assert ei.value.errno == errno.ENOENT
    assert not h.is_poisoned()
    with pytest.raises(AioError) as ei:
        h.sync_pread(torch.empty(10), 987654)  # not an open fd
    assert ei.value.errno == errno.ENOENT or ei.value.errno == errno.EBADF


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("intra", [1, 2])
def test_injected_read_eio(d, backend, intra):
    block = 4096
    h = handle(backend, intra=intra, block=block, qd=4, faults=[("read", 2, errno.EIO)])
    data = rand_bytes(8 * block, 3)
    p = os.path.join(d, "f")
    put_file(p, data)
    u = torch.empty(len(data), dtype=torch.uint8)
    assert h.async_pread(u, p) == 0
    with pytest.raises(AioError) as ei:
        h.wait()
    e = ei.value
    assert e.errno == errno.EIO and isinstance(e, OSError)
    assert e.filename == p
    assert e.offset % block == 0 and 0 <= e.offset < len(data)
    assert e.length == block
    assert h.wait() == 0  # the failed op is gone
    assert not h.is_poisoned()  # a failed read does not poison
    assert h.sync_pread(u, p) == 1
    assert tensor_bytes(u) == data
    # From a sync call.
    h = handle(backend, intra=intra, block=block, qd=4, faults=[("any", 1, errno.EIO)])
    with pytest.raises(AioError) as ei:
        h.sync_pread(u, p, 0)
    assert (ei.value.errno, ei.value.filename, ei.value.length) == (errno.EIO, p, block)
    assert h.sync_pread(u, p) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_injected_read_eof(d, backend):
    h = handle(backend, block=4096, faults=[("read", 1, -2)])
    p = os.path.join(d, "f")
    put_file(p, rand_bytes(3 * 4096, 4))
    with pytest.raises(AioError) as ei:
        h.sync_pread(torch.empty(3 * 4096, dtype=torch.uint8), p)
    assert ei.value.errno == errno.EIO
    assert ei.value.filename == p
    assert ei.value.length == 4096
    assert not h.is_poisoned()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sync", [True, False])
def test_injected_write_enospc_poisons(d, backend, sync):
    block = 4096
    h = handle(backend, block=block, faults=[("write", 2, errno.ENOSPC)])
    p = os.path.join(d, "f")
    t = tensor_with("locked", "uint8", rand_bytes(4 * block, 5), h)
    if sync:
        with pytest.raises(AioError) as ei:
            h.sync_pwrite(t, p, 8192)
    else:
        assert h.async_pwrite(t, p, 8192) == 0
        with pytest.raises(AioError) as ei:
            h.wait()
    e = ei.value
    assert e.errno == errno.ENOSPC
    assert e.filename == p
    assert 8192 <= e.offset < 8192 + 4 * block and e.offset % block == 0
    assert e.length == block
    assert h.is_poisoned()
    # The failed write's error says the handle is done, and the way on
    # (DeepSpeed's handle goes on after a failed op).
    fix = "this aio_handle refuses every op after a failed write (DeepSpeed's goes on): create a new aio_handle"
    assert fix in str(e) and str(e).count(fix) == 1
    assert h.wait() == 0
    # Every later op raises at once, naming the first failure.
    other = os.path.join(d, "other")
    put_file(other, bytes(100))
    for call in (lambda: h.sync_pwrite(t, other), lambda: h.async_pwrite(t, other),
                 lambda: h.sync_pread(t[:100], other), lambda: h.async_pread(t[:100], other),
                 lambda: h.write(t, other, False), lambda: h.pread(t[:100], other, False, True)):
        with pytest.raises(AioError) as ei2:
            call()
        assert isinstance(ei2.value, OSError)
        assert "No space left" in str(ei2.value) or "ENOSPC" in str(ei2.value) or str(errno.ENOSPC) in str(ei2.value)
        # Said as the handle's, not as a "swap space" the caller never made.
        assert "this aio_handle is poisoned by an earlier failed write" in str(ei2.value)
        assert "swap space" not in str(ei2.value) and fix in str(ei2.value)
    assert h.wait() == 0
    assert file_bytes(other) == bytes(100)  # untouched
    # Another handle is not poisoned.
    assert handle(backend).sync_pwrite(t, other) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_async_op_among_others(d, backend):
    """wait() raises the error once every pending op is done; the others land.
    (Reads fail here: a failed write would poison the handle while the next
    op is being submitted.)"""
    h = handle(backend, block=4096, faults=[("read", 3, errno.EIO)])
    data = [rand_bytes(4 * 4096 + i, 50 + i) for i in range(4)]
    ps = [os.path.join(d, f"f{i}") for i in range(4)]
    for x, p in zip(data[:2], ps[:2]):
        put_file(p, x)
    us = [make_tensor("torch", "uint8", len(x), h) for x in data[:2]]
    ts = [tensor_with("torch", "uint8", x, h) for x in data[2:]]
    assert h.async_pread(us[0], ps[0]) == 0
    assert h.async_pwrite(ts[0], ps[2]) == 0
    assert h.async_pread(us[1], ps[1]) == 0
    assert h.async_pwrite(ts[1], ps[3]) == 0
    with pytest.raises(AioError) as ei:
        h.wait()
    assert ei.value.errno == errno.EIO
    assert ei.value.filename in ps[:2]
    assert not h.is_poisoned()
    assert h.wait() == 0
    bad = ps.index(ei.value.filename)
    assert tensor_bytes(us[1 - bad]) == data[1 - bad]
    assert file_bytes(ps[2]) == data[2]
    assert file_bytes(ps[3]) == data[3]


def test_sync_op_raises_pending_async_error(d):
    h = handle(block=4096, faults=[("read", 1, errno.EIO)])
    p = os.path.join(d, "f")
    put_file(p, rand_bytes(8192, 1))
    u = torch.empty(8192, dtype=torch.uint8)
    assert h.async_pread(u, p) == 0
    t = tensor_with("torch", "uint8", rand_bytes(100, 2), h)
    with pytest.raises(AioError) as ei:
        h.sync_pwrite(t, os.path.join(d, "g"))  # waits for the failed read too
    assert ei.value.errno == errno.EIO and ei.value.filename == p
    assert file_bytes(os.path.join(d, "g")) == tensor_bytes(t)
    assert h.wait() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("kind", ["locked", "torch_unaligned"])
def test_injected_short_transfer_still_right(d, backend, op, kind):
    size = (1 << 20) + 3 * 4096 + 11
    h = handle(backend, block=1 << 20, faults=[(op, 1, -1), (op, 2, -1)])
    data = rand_bytes(size, 6)
    p = os.path.join(d, "f")
    if op == "read":
        put_file(p, bytes(4096) + data)
        u = make_tensor(kind, "uint8", size, h)
        assert h.sync_pread(u, p, 4096) == 1
        assert tensor_bytes(u) == data
    else:
        t = tensor_with(kind, "uint8", data, h)
        assert h.sync_pwrite(t, p, 4096) == 1
        assert file_bytes(p) == bytes(4096) + data
    assert not h.is_poisoned()


@pytest.mark.parametrize("bad", [("seek", 1, 5), ("read", 1, 0), ("read", 1, -3)])
def test_bad_fault_specs(bad):
    with pytest.raises((ValueError, TypeError, OverflowError)):
        aio.aio_handle(_faults=[bad])


def test_validate_passes_on_good_ops(d):
    h = handle(intra=2, block=65536)
    p = os.path.join(d, "f")
    for kind in ("locked", "torch", "numpy"):
        data = rand_bytes(200003, 7)
        t = tensor_with(kind, "uint8", data, h)
        assert h.write(t, p, True) == 0
        assert h.pwrite(t, p, True, False, 3) == 1
        assert h.pwrite(t, p, True, True, 5) == 0
        assert h.wait() == 1
        u = make_tensor(kind, "uint8", len(data), h)
        assert h.pread(u, p, True, True, 5) == 0
        assert h.wait() == 1
        assert tensor_bytes(u) == data
        assert h.pread(u, p, True, False, 0) == 1
        assert tensor_bytes(u) == (data[:3] + data[:2] + data)[: len(data)]


def test_validate_by_fd(d):
    h = handle()
    p = os.path.join(d, "f")
    data = rand_bytes(10000, 8)
    t = tensor_with("torch", "uint8", data, h)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert h.pwrite(t, fd, True, False, 0) == 1
        u = make_tensor("torch", "uint8", len(data), h)
        assert h.pread(u, fd, True, False, 0) == 1
        assert tensor_bytes(u) == data
    finally:
        os.close(fd)


def test_validate_by_fd_reads_short_reads_to_the_end(d, monkeypatch):
    # One pread returns at most about 2 GiB (and may return less): the
    # check reads on until it has the bytes.
    h = handle()
    p = os.path.join(d, "f")
    data = rand_bytes(10000, 11)
    t = tensor_with("torch", "uint8", data, h)
    real = os.pread
    monkeypatch.setattr(aio.os, "pread", lambda fd, n, off: real(fd, min(n, 999), off))
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert h.pwrite(t, fd, True, False, 0) == 1
    finally:
        os.close(fd)


def test_validate_by_a_write_only_fd_is_an_aio_error(d):
    h = handle()
    p = os.path.join(d, "f")
    t = tensor_with("torch", "uint8", rand_bytes(4096, 12), h)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(AioError) as e:
            h.pwrite(t, fd, True, False, 0)
        assert f"fd {fd} cannot be read" in str(e.value) and "O_RDWR" in str(e.value)
    finally:
        os.close(fd)


class _UserTensor(torch.Tensor):
    """A tensor subclass from a module that is not torch's."""


def test_tensor_subclasses_of_other_modules_are_tensors(d):
    h = handle()
    p = os.path.join(d, "f")
    data = rand_bytes(8192, 13)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).as_subclass(_UserTensor)
    assert h.write(t, p, True) == 0
    u = torch.zeros(len(data), dtype=torch.uint8).as_subclass(_UserTensor)
    assert h.read(u, p, True) == 0
    assert u.numpy().tobytes() == data


# --------------------------------------------------------------------------
# Lifetimes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["torch", "numpy", "locked", "noncontig"])
def test_tensor_dropped_before_wait(d, backend, kind):
    h = handle(backend, intra=2, block=65536, qd=2)
    size = 8 << 20
    data = rand_bytes(size, 9)
    p = os.path.join(d, "f")

    def submit():
        if kind == "noncontig":
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(2, -1).t().contiguous().t()
            assert not t.is_contiguous() and tensor_bytes(t) == data
        else:
            t = tensor_with(kind, "uint8", data, h)
        assert h.async_pwrite(t, p, 1) == 0
        return None  # the only reference goes with this frame

    submit()
    gc.collect()
    # Churn the allocator so freed memory would be overwritten.
    junk = [torch.full((1 << 20,), 0xAB, dtype=torch.uint8) for _ in range(16)]
    assert h.wait() == 1
    del junk
    assert file_bytes(p) == bytes(1) + data
    # Reads: keep the tensor, drop every other reference.
    u = make_tensor("torch", "uint8", size, h)
    assert h.async_pread(u, p, 1) == 0
    gc.collect()
    assert h.wait() == 1
    assert tensor_bytes(u) == data


def test_handle_dropped_with_ops_pending(d):
    p = os.path.join(d, "f")
    data = rand_bytes(4 << 20, 10)
    h = handle(block=65536, qd=2)
    assert h.async_pwrite(tensor_with("torch", "uint8", data, h), p) == 0
    del h
    gc.collect()
    assert file_bytes(p) == data


# --------------------------------------------------------------------------
# CUDA tensors
# --------------------------------------------------------------------------


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@cuda
@pytest.mark.parametrize("validate", [False, True])
def test_cuda_tensors(d, validate):
    h = handle(intra=2)
    p = os.path.join(d, "f")
    src = torch.randn(300001, device="cuda")
    assert h.pwrite(src, p, validate, False, 3) == 1
    assert file_bytes(p)[3:] == tensor_bytes(src)
    dst = torch.zeros_like(src)
    assert h.pread(dst, p, validate, True, 3) == 0
    assert h.wait() == 1
    assert torch.equal(dst, src)
    assert h.sync_pread(dst, p, 3) == 1
    assert torch.equal(dst, src)


@cuda
def test_torch_pinned_is_pinned(d):
    h = handle()
    t = torch.empty(1 << 16, pin_memory=True)
    assert h.is_pinned(t)
    assert h.free_cpu_locked_tensor(t) is False
    p = os.path.join(d, "f")
    t.uniform_()
    assert h.sync_pwrite(t, p) == 1
    assert file_bytes(p) == tensor_bytes(t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_shared_by_threads_returns_each_sync_op_landed(d, backend):
    # DeepSpeed's test_concurrent_blocking_reads_on_shared_handle: two
    # threads, one handle, a sync read each. The native wait takes every
    # pending op, so without the handle's lock one thread's wait took both
    # and the other's returned 0 at once, its read still in flight.
    import threading

    h = handle(backend)
    data = [rand_bytes(1 << 20, 30 + i) for i in range(2)]
    ps = [os.path.join(d, f"s{i}") for i in range(2)]
    for p, x in zip(ps, data):
        put_file(p, x)
    barrier = threading.Barrier(2)

    class Racing:
        """The native handle, with both threads' submissions made before
        either thread records its op (as the GIL released in submit
        allows)."""

        def __init__(self, inner):
            self._inner = inner

        def submit(self, *a):
            r = self._inner.submit(*a)
            try:
                barrier.wait(timeout=1)
            except threading.BrokenBarrierError:
                pass
            return r

        def __getattr__(self, name):
            return getattr(self._inner, name)

    h._h = Racing(h._h)
    # Non-contiguous destinations: the read lands in a bounce buffer that
    # is copied back at the wait.
    outs = [torch.zeros(2 << 20, dtype=torch.uint8)[::2] for _ in range(2)]
    counts = [None, None]

    def read(i):
        counts[i] = h.sync_pread(outs[i], ps[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [1, 1]
    assert [bytes(o.contiguous().numpy()) for o in outs] == data

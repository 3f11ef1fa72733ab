"""``tierzero.deepspeed.install()``: DeepSpeed's own DeepNVMe users on our handle.

Skipped when deepspeed is not installed. Nothing here builds a DeepSpeed op:
with install() active, ``AsyncIOBuilder().load()`` is ``tierzero.aio``; after
uninstall() only the identity of DeepSpeed's methods is checked.
"""

from __future__ import annotations

import os
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import tierzero.aio as tz_aio  # noqa: E402
import tierzero.deepspeed as tz_ds  # noqa: E402


@pytest.fixture
def installed(monkeypatch):
    import deepspeed.comm as dist

    # The swappers ask for the rank; there is no process group here.
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    classes = tz_ds.install()
    yield classes
    tz_ds.uninstall()


def _originals():
    import deepspeed.ops.op_builder.async_io as generic

    out = {}
    for cls in tz_ds._candidate_classes():
        out[cls] = {name: cls.__dict__.get(name, tz_ds._MISSING) for name in ("load", "is_compatible")}
    assert generic.AsyncIOBuilder in out  # the generic class is always among them
    return out


def test_install_and_uninstall():
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops.op_builder as ob
    import deepspeed.ops.aio as ds_aio

    before = _originals()
    assert not tz_ds.installed()
    classes = tz_ds.install()
    try:
        assert tz_ds.installed()
        assert tz_ds.install() == classes  # idempotent
        acc_cls = get_accelerator().get_op_builder("AsyncIOBuilder")
        assert acc_cls in classes
        assert ob.AsyncIOBuilder in classes or not isinstance(ob.AsyncIOBuilder, type)
        # Every route DeepSpeed code takes to the builder.
        assert ob.AsyncIOBuilder().load() is tz_aio
        assert ob.AsyncIOBuilder().load(verbose=False) is tz_aio
        assert ob.AsyncIOBuilder().is_compatible() is True
        assert ob.AsyncIOBuilder().is_compatible(verbose=True) is True
        assert ds_aio.AsyncIOBuilder().load() is tz_aio
        assert acc_cls().load() is tz_aio
        m = ob.AsyncIOBuilder().load()
        h = m.aio_handle(block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=True,
                         intra_op_parallelism=2)
        assert isinstance(h, tz_aio.aio_handle) and h.get_intra_op_parallelism() == 2
        for name in ("aio_read", "aio_write", "deepspeed_memcpy"):
            assert callable(getattr(m, name))
        # Subclasses (GDSBuilder) keep DeepSpeed's behaviour.
        from deepspeed.ops.op_builder.gds import GDSBuilder

        assert "is_compatible" in GDSBuilder.__dict__  # its own, untouched
        for base in classes:
            sub = type("Sub", (base,), {})
            orig = tz_ds._inherited(sub, "load")
            assert orig is not tz_ds._patched_load
            assert orig is (before[base]["load"] if before[base]["load"] is not tz_ds._MISSING
                            else getattr(base.__mro__[1], "load"))
    finally:
        tz_ds.uninstall()
    assert not tz_ds.installed()
    after = _originals()
    assert after == before
    for cls in before:
        assert cls.load is not tz_ds._patched_load
        assert cls.is_compatible is not tz_ds._patched_is_compatible


def test_swap_out_and_in_tensors(installed, tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

    h = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, True, 2)
    srcs = [torch.randn(n) for n in (1 << 18, 12345, 1)]  # sizes DeepSpeed's own handle cannot do
    paths = [str(tmp_path / f"t{i}.swp") for i in range(len(srcs))]
    swap_out_tensors(h, srcs, paths)
    assert h.wait() == len(srcs)
    for s, p in zip(srcs, paths):
        assert open(p, "rb").read() == s.numpy().tobytes()
    dst = [torch.empty_like(s) for s in srcs]
    swap_in_tensors(h, dst, paths)
    assert h.wait() == len(srcs)
    assert all(torch.equal(a, b) for a, b in zip(srcs, dst))


def test_swap_buffer_pool_and_async_tensor_swapper(installed, tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.runtime.swap_tensor.async_swapper import AsyncTensorSwapper
    from deepspeed.runtime.swap_tensor.utils import SwapBufferPool

    h = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, True, 1)
    bufs = [h.new_cpu_locked_tensor(1 << 16, torch.empty(0)) for _ in range(2)]
    pool = SwapBufferPool(bufs, h)  # asserts is_pinned() of each buffer
    srcs = [torch.randn(n) for n in (5000, 7000, 30000)]
    paths = [str(tmp_path / f"p{i}.swp") for i in range(len(srcs))]
    aligned = [(s.numel() + 1023) // 1024 * 1024 for s in srcs]
    for s, p, a in zip(srcs, paths, aligned):
        assert pool.insert_tensor(s, p, a)[0] is not None
    pool.swap_out(h)
    pool.reset()
    cts = [pool.allocate_tensor(s.numel(), p, a)[1] for s, p, a in zip(srcs, paths, aligned)]
    pool.swap_in(h)
    assert all(torch.equal(a, b) for a, b in zip(srcs, cts))

    sw = AsyncTensorSwapper(h, numel_alignment=512, timers=None)
    sw.add_buffers([h.new_cpu_locked_tensor(1 << 16, torch.empty(0)) for _ in range(3)])
    srcs = [torch.randn(n) for n in (40000, 30000, 1000, 65536, 20000, 3)]
    paths = [str(tmp_path / f"a{i}.swp") for i in range(len(srcs))]
    sw.swap_out_tensors(srcs, paths)
    for b in sw.release_buffers():  # flushes and waits
        assert h.free_cpu_locked_tensor(b)
    for s, p in zip(srcs, paths):
        want = s.numpy().tobytes()
        assert open(p, "rb").read()[: len(want)] == want


def _aio_config(intra=2):
    from deepspeed.runtime.swap_tensor.constants import (AIO_BLOCK_SIZE, AIO_INTRA_OP_PARALLELISM,
                                                         AIO_OVERLAP_EVENTS, AIO_QUEUE_DEPTH, AIO_SINGLE_SUBMIT,
                                                         AIO_USE_GDS)

    return {AIO_BLOCK_SIZE: 1 << 20, AIO_QUEUE_DEPTH: 8, AIO_SINGLE_SUBMIT: False, AIO_OVERLAP_EVENTS: True,
            AIO_INTRA_OP_PARALLELISM: intra, AIO_USE_GDS: False}


def test_partitioned_parameter_swapper(installed, tmp_path):
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (AsyncPartitionedParameterSwapper,
                                                                         PartitionedParamStatus)

    cfg = types.SimpleNamespace(aio_config=_aio_config(), zero_config=types.SimpleNamespace(
        offload_param=types.SimpleNamespace(nvme_path=str(tmp_path), buffer_size=300000, buffer_count=4)))
    sw = AsyncPartitionedParameterSwapper(cfg, torch.float32)
    assert isinstance(sw.aio_read_handle, tz_aio.aio_handle)
    assert sw.aio_read_handle.is_pinned(sw.buffers)

    def fake(i, n):
        t = torch.empty(0)
        t.ds_numel, t.status = n, PartitionedParamStatus.AVAILABLE
        return types.SimpleNamespace(ds_id=i, ds_tensor=t)

    data = {i: torch.randn(n) for i, n in enumerate((300000, 123457, 4096))}
    params = [fake(i, d.numel()) for i, d in data.items()]
    for p in params:
        buf = sw.get_buffer(p, data[p.ds_id].numel())
        buf.copy_(data[p.ds_id])
        p.ds_tensor.data = buf
    sw.swap_out_and_release(params)
    assert all(p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE for p in params)
    sw.swap_in(params[:2], async_op=True)
    sw.synchronize_reads()
    for p in params[:2]:
        assert torch.equal(p.ds_tensor.data, data[p.ds_id])
    dest = torch.empty(4096)  # not pinned: goes through one of the swapper's buffers
    sw.swap_into_buffer(params[2], dest)
    assert torch.equal(dest, data[2])
    sw.remove_partition_and_release_buffers(params[:2])
    # fp32 partitions through the partitioned swap pool into the params' files.
    sw.reserve_partitioned_swap_space([d.numel() for d in data.values()])
    new = {i: torch.randn(d.numel()) for i, d in data.items()}
    sw.swap_out_partitioned_params(params, [new[i] for i in range(len(params))])
    sw.swap_in(params, async_op=False)
    for p in params:
        assert torch.equal(p.ds_tensor.data, new[p.ds_id])


def test_partitioned_optimizer_swapper_adam_steps(installed, tmp_path):
    """ZeRO-Infinity's optimizer-state swapping: Adam steps with the
    parameters and their state living on disk between steps give the same
    numbers as in memory."""
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    numels = [1 << 18, 3 * (1 << 16) + 512]
    g = torch.Generator().manual_seed(0)
    params = []
    for i, n in enumerate(numels):
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.ds_id = f"p{i}"
        params.append(p)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.Adam(params, lr=1e-2)
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    sw = PartitionedOptimizerSwapper(types.SimpleNamespace(buffer_count=6), _aio_config(), str(tmp_path), opt,
                                     max(numels), "cpu", torch.float32, None)
    assert isinstance(sw.aio_handle, tz_aio.aio_handle)
    sw.initialize_parameters(parameters=params, src_tensors=[p.detach().clone() for p in params])
    for p in params:
        p.data = torch.empty(0)  # on disk only
    for _ in range(2):
        grads = [torch.randn(n, generator=g) for n in numels]
        for p, r, gr in zip(params, ref, grads):
            sw.swap_in_optimizer_state(parameter=p)
            p.grad, r.grad = gr.clone(), gr.clone()
        opt.step()
        ref_opt.step()
        for p in params:
            sw.swap_out_optimizer_state(parameter=p)
            assert p.numel() == 0  # released again
    for p, r in zip(params, ref):
        sw.swap_in_optimizer_state(parameter=p)
        assert torch.equal(p.data, r.data)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], ref_opt.state[r][k])
        sw.release_swap_buffers(p)
    assert os.listdir(tmp_path)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_fast_file_writer_torch_save(installed, tmp_path, monkeypatch, double_buffer):
    """DeepSpeed's checkpoint writer: torch.save through async_pwrite by fd
    (an O_DIRECT fd it opens itself), and its unaligned tail by plain write."""
    import deepspeed.io.fast_file_writer as ffw
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    from deepspeed.ops.op_builder import AsyncIOBuilder

    try:
        ffw.UtilsBuilder().load()
    except Exception:  # noqa: BLE001
        # No UtilsBuilder on this accelerator (the CPU one has none): its
        # cast_to_byte_tensor is a byte view.
        def cast(x):
            if isinstance(x, (list, tuple)):
                return [cast(t) for t in x]
            return x.contiguous().reshape(-1).view(torch.uint8)

        monkeypatch.setattr(ffw, "UtilsBuilder",
                            lambda: types.SimpleNamespace(load=lambda *a, **k: types.SimpleNamespace(
                                cast_to_byte_tensor=cast)))
    h = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, True, 1)
    pinned = h.new_cpu_locked_tensor(4 << 20, torch.empty(0, dtype=torch.uint8))
    path = str(tmp_path / "ckpt.pt")
    sd = {"w": torch.randn(1000, 1000), "b": torch.arange(77), "s": "x" * 1001}
    w = FastFileWriter(path, FastFileWriterConfig(dnvme_handle=h, pinned_tensor=pinned,
                                                  double_buffer=double_buffer))
    torch.save(sd, w)
    w.close()
    back = torch.load(path)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"]) and back["s"] == sd["s"]
    del w


def test_ds_io_workers_get_the_handle_from_a_module_level_install(tmp_path):
    """The module docs' recipe for DeepSpeed's ``ds_io`` benchmark, whose
    I/O runs in spawned workers: ``install()`` at module level, which each
    worker runs again as it re-imports the script. (The docs claimed the
    ``deepspeed.nvme`` benchmarks got our handle; the ``ds_io`` command
    never calls ``install()``, and its workers do not inherit it.)"""
    import subprocess
    import sys
    import textwrap

    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "io").mkdir()
    script = tmp_path / "run_ds_io.py"
    script.write_text(textwrap.dedent(f"""
        import os
        import tierzero.aio
        import tierzero.deepspeed
        tierzero.deepspeed.install()
        from deepspeed.nvme import ds_io_main

        # Marks each process that builds one of our handles.
        _init = tierzero.aio.aio_handle.__init__
        def _marked(self, *a, **k):
            open(os.path.join({str(marks)!r}, str(os.getpid())), "w").close()
            _init(self, *a, **k)
        tierzero.aio.aio_handle.__init__ = _marked

        if __name__ == "__main__":
            print("main", os.getpid(), flush=True)
            ds_io_main()
    """))
    r = subprocess.run(
        [sys.executable, str(script), "--folder", str(tmp_path / "io"), "--io_size", "1M", "--loops", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    main = next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("main "))
    workers = [m.name for m in marks.iterdir() if m.name != main]
    assert workers, (sorted(m.name for m in marks.iterdir()), main, r.stdout[-2000:])

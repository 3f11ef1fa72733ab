"""tierzero.torch.offload_parameters: ZeRO-3 param offload for any nn.Module."""

import types

import pytest

torch = pytest.importorskip("torch")
import tierzero.torch as tzt  # noqa: E402


class Net(torch.nn.Module):
    """Tied embedding and head, a shared block used twice, a small bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 64)
        self.block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.block(h)
        h = h + self.block(self.norm(h))
        return self.head(h)


def train(offload, tmp_path, steps=6, opt_kind="tz"):
    m = Net()
    handle = None
    if offload:
        handle = tzt.offload_parameters(m, offload, nvme_path=tmp_path / "p", param_persistence_threshold=100, prefetch_bucket_size=20_000)
    if opt_kind == "tz":
        opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none")
    g = torch.Generator().manual_seed(1)
    losses, live_between = [], []
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 16), generator=g)
        loss = torch.nn.functional.cross_entropy(m(ids).reshape(-1, 50), ids.reshape(-1))
        if handle is not None:
            live_between.append(handle.live_numel())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if handle is not None:
        assert handle.live_numel() == 0  # everything released between steps
        handle.remove()
    return losses, [p.detach().clone() for p in m.parameters()], live_between, handle


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_is_bit_identical(device, tmp_path):
    ref, ref_params, _, _ = train(None, tmp_path)
    got, params, live, handle = train(device, tmp_path)
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    # After forward, before backward, only the params under the threshold
    # (biases, norms) are live.
    assert all(n == 0 for n in live)
    if device == "nvme":
        assert handle.prefetched > 0 and handle.fetched_bytes > 0


def test_remove_restores_the_model(tmp_path):
    m = Net()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    h = tzt.offload_parameters(m, "nvme", nvme_path=tmp_path, param_persistence_threshold=100)
    assert m.block[0].weight.numel() == 0
    with h.gathered():
        assert m.block[0].weight.shape == (256, 64)
    h.remove()
    assert m.head.weight is m.emb.weight
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert list(tmp_path.iterdir()) == []
    # The hooks are gone: a forward leaves the params alone.
    m(torch.zeros(1, 3, dtype=torch.long))
    assert m.block[0].weight.numel() == 256 * 64


def test_a_forward_that_raised_leaves_no_param_live():
    # Its params stayed gathered, and under no_grad nothing released them
    # again: an OOM retry or a batch-size finder turned the offload off.
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 2))
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=0)
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 5))
    with torch.no_grad():
        m(torch.randn(2, 32))
    assert h.live_numel() == 0
    h.remove()


def test_persistence_follows_deepspeed_s_two_thresholds():
    # At most param_persistence_threshold elements (DeepSpeed's <=), within
    # model_persistence_threshold in all, in named_parameters order: a
    # param that would pass the model bound gets a home. Without the model
    # bound every small param stayed on the module, whatever the model's size.
    from tierzero.offload import home_of

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # 16, 4, 16, 4
    homed = lambda: [home_of(p) is not None for p in m.parameters()]  # noqa: E731
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=16)
    assert homed() == [False] * 4
    h.remove()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=15)
    assert homed() == [True, False, True, False]
    h.remove()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100, model_persistence_threshold=20)
    assert homed() == [False, False, True, True]
    h.remove()
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 100,
                                 "stage3_model_persistence_threshold": 36}}
    h = tzt.offload_parameters(m, ds_config=cfg)
    assert homed() == [False, False, False, True]
    h.remove()
    assert homed() == [False] * 4


def test_a_second_offload_of_an_offloaded_model_is_refused(tmp_path):
    # Its params' placeholders are empty, under any threshold: the second
    # offload_parameters offloaded nothing and said nothing.
    m = Net()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    with pytest.raises(ValueError, match="already offloaded.*remove"):
        tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    h.remove()
    tzt.offload_parameters(m, "cpu", param_persistence_threshold=100).remove()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_state_dict_and_load_state_dict_see_the_whole_params(device, tmp_path):
    # HF's save_model and resume: a released param's entry was its empty
    # data (shape [0]), and loading into it failed on the size.
    want = Net().state_dict()
    m = Net()
    h = tzt.offload_parameters(m, device, nvme_path=tmp_path / "p", param_persistence_threshold=100)
    assert h.live_numel() == 0
    sd = m.state_dict()
    assert sd.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(sd[k], v), k
    assert h.live_numel() == 0, "state_dict() left params live"
    # Other values load into the homes: a forward and gathered() see them.
    other = {k: v + 1 for k, v in want.items()}
    m.load_state_dict(other)
    assert h.live_numel() == 0, "load_state_dict() left params live"
    with h.gathered():
        for k, v in m.state_dict().items():
            assert torch.equal(v, other[k]), k
    ref = Net()
    ref.load_state_dict(other)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(m(ids), ref(ids))
    h.remove()


def test_the_swap_file_goes_at_exit_without_remove(tmp_path):
    # HF's recipe never calls remove(): every run left a model-sized file.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import tierzero.torch as tzt
        from test_offload_params import Net
        h = tzt.offload_parameters(Net(), "nvme", nvme_path={str(tmp_path / "p")!r}, param_persistence_threshold=100)
        import os
        print(len(os.listdir({str(tmp_path / "p")!r})))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1", out.stdout
    assert list((tmp_path / "p").iterdir()) == []


def test_a_killed_process_file_goes_with_the_next_offload(tmp_path):
    # A SIGKILLed run runs no finalizer: its model-sized file stayed in
    # nvme_path for good.
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "p"
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import tierzero.torch as tzt
        from test_offload_params import Net
        h = tzt.offload_parameters(Net(), "nvme", nvme_path={str(d)!r}, param_persistence_threshold=100)
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    (left,) = [p.name for p in d.iterdir()]
    assert left.startswith(f"tierzero-params-{child.pid}-")
    # A file not ours stays. (Files named with a live pid, this
    # process's included, whose lock is free are stale: pids are reused;
    # test_a_params_file_whose_lock_is_free_is_reclaimed_whatever_its_pid.)
    other = d / "tierzero-params-notapid-1.bin"
    other.write_bytes(b"x")
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert (d / left).exists()
    # A file whose pid means nothing here but whose lock is held: a live
    # offload in another PID namespace, or on another host sharing the
    # directory. It stays.
    import fcntl

    held = d / f"tierzero-params-{child.pid}-beef.bin"
    held.write_bytes(b"x")
    fd = os.open(held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.warns(UserWarning, match="removed 1 file"):
            h = tzt.offload_parameters(Net(), "nvme", nvme_path=d, param_persistence_threshold=100)
    finally:
        os.close(fd)
    names = {p.name for p in d.iterdir()}
    assert left not in names
    assert {other.name, held.name} <= names
    h.remove()


def test_ds_config_supplies_the_settings(tmp_path):
    cfg = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "ds")},
            "stage3_param_persistence_threshold": 10,
            "stage3_prefetch_bucket_size": 1000,
        }
    }
    h = tzt.offload_parameters(Net(), ds_config=cfg)
    assert h.device == "nvme" and h.persistence_threshold == 10 and h.prefetch_bucket_size == 1000
    h.remove()
    # A config that offloads no params is not a CPU offload (it was).
    for none in ({"stage": 3}, {"stage": 3, "offload_param": {"device": "none"}}):
        with pytest.raises(ValueError, match="offloads no params"):
            tzt.offload_parameters(Net(), ds_config={"zero_optimization": none})
    # An explicit device still wins.
    h = tzt.offload_parameters(Net(), "cpu", ds_config={"zero_optimization": {"stage": 3}})
    assert h.device == "cpu"
    h.remove()
    # "auto" is HF's rule of the model's config.hidden_size (0.9 x hidden²,
    # 10 x hidden; it was DeepSpeed's fixed defaults, the README's table
    # notwithstanding), and DeepSpeed's defaults for a model without one.
    auto = {"stage": 3, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    h = tzt.offload_parameters(Net(), "cpu", ds_config={"zero_optimization": auto})
    assert (h.prefetch_bucket_size, h.persistence_threshold) == (50_000_000, 100_000)
    h.remove()
    hf = Net()
    hf.config = types.SimpleNamespace(hidden_size=64)
    h = tzt.offload_parameters(hf, "cpu", ds_config={"zero_optimization": auto})
    assert (h.prefetch_bucket_size, h.persistence_threshold) == (3686, 640)
    h.remove()


def test_several_processes_are_refused(tmp_path, monkeypatch):
    # Under DDP (torchrun, HF Trainer's multi-process runs) backward died
    # inside torch ("TBackward0 returned an invalid gradient ... expected
    # shape compatible with [0]"), DDP wrapping before or after the offload.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    m = Net()
    for device in ("cpu", "nvme"):
        with pytest.raises(RuntimeError, match=r"one process only, and this is rank 1 of 2.*DeepSpeed's own engine.*tierzero.deepspeed.install\(\)"):
            tzt.offload_parameters(m, device, nvme_path=tmp_path / "p", param_persistence_threshold=100)
    assert all(p.numel() for p in m.parameters())  # nothing was offloaded
    assert not (tmp_path / "p").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    tzt.offload_parameters(m, "cpu", param_persistence_threshold=100).remove()


def test_a_process_group_initialised_after_the_offload_is_refused_at_the_forward(monkeypatch):
    # torch.distributed initialised (and DDP wrapped) after the offload,
    # with no WORLD_SIZE to see at offload_parameters: each forward's first
    # hook refuses, before anything is fetched.
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    m = Net()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    ids = torch.randint(0, 50, (2, 8))
    ref = m(ids).detach()
    dist.init_process_group("fake", rank=0, world_size=2, store=fake_pg.FakeStore())
    try:
        with pytest.raises(RuntimeError, match="one process only, and this is rank 0 of 2"):
            m(ids)
        assert h.live_numel() == 0
    finally:
        dist.destroy_process_group()
    assert torch.equal(m(ids), ref)  # one process again: it runs
    h.remove()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_changes_made_while_gathered_are_kept(device, tmp_path):
    # The module docs' recipe for a torch optimizer: step it inside
    # gathered(). With cpu homes the update was dropped at release.
    m = Net()
    h = tzt.offload_parameters(m, device, nvme_path=tmp_path / "p", param_persistence_threshold=0)
    sgd = torch.optim.SGD(m.parameters(), lr=1.0)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    m(ids).sum().backward()
    with h.gathered():
        expected = {n: (p.detach() - p.grad).clone() for n, p in m.named_parameters()}
        sgd.step()
    with h.gathered():
        for n, p in m.named_parameters():
            assert torch.equal(p.detach(), expected[n]), n
    h.remove()


def test_a_failed_prefetch_never_becomes_a_param(tmp_path):
    m = Net()
    h = tzt.offload_parameters(m, "nvme", nvme_path=tmp_path / "p", param_persistence_threshold=0)
    target = next(x for x in h._homes if x.offset is not None)
    target.inflight = torch.full(target.shape, 7.0, dtype=target.dtype)

    class Failing:
        def wait(self):
            raise OSError(5, "injected")

    real, h._aio = h._aio, Failing()
    with pytest.raises(OSError):
        h._load(target)
    h._aio = real
    assert all(x.inflight is None for x in h._homes)
    # Read again from its home: its own values, not the unfilled buffer.
    assert not torch.equal(h._load(target), torch.full(target.shape, 7.0, dtype=target.dtype))
    # A sync read of another param that fails with the prefetch's error
    # (it waits for every op in flight) drops the prefetch too.
    other = next(x for x in h._homes if x.offset is not None and x is not target)
    target.inflight = torch.full(target.shape, 7.0, dtype=target.dtype)

    class FailingRead:
        def sync_pread(self, *a):
            raise OSError(5, "injected")

        def wait(self):
            return 0

    real, h._aio = h._aio, FailingRead()
    with pytest.raises(OSError):
        h._load(other)
    h._aio = real
    assert target.inflight is None
    # A prefetch whose read failed to issue left its unfilled buffer in
    # flight, for the next fetch to install.
    with torch.no_grad():
        m(torch.zeros(1, 3, dtype=torch.long))  # records the module trace
    h._recording = False

    class FailingIssue:
        def async_pread(self, *a):
            raise OSError(5, "injected")

        def wait(self):
            return 0

    real, h._aio = h._aio, FailingIssue()
    with pytest.raises(OSError):
        h._prefetch_after(h._trace[0])
    h._aio = real
    assert all(x.inflight is None for x in h._homes)
    # A remove() whose wait fails drops the prefetches too (a second
    # remove() installed the unfilled buffer).
    target.inflight = torch.full(target.shape, 7.0, dtype=target.dtype)
    real, h._aio = h._aio, Failing()
    with pytest.raises(OSError):
        h.remove()
    h._aio = real
    assert target.inflight is None
    h.remove()
    assert not torch.equal(target.param.detach(), torch.full(target.shape, 7.0, dtype=target.dtype))


def _mlp(inplace=False, frozen=False):
    torch.manual_seed(3)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 512), torch.nn.ReLU(inplace=inplace), torch.nn.Linear(512, 8)
    )
    if frozen:
        for layer in (m[1], m[3]):
            for p in layer.parameters():
                p.requires_grad_(False)
    return m


def _grads(m, offload, tmp_path):
    h = None
    if offload:
        h = tzt.offload_parameters(m, offload, nvme_path=tmp_path / "p", param_persistence_threshold=100)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    m(x).square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    return grads, h


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_an_offloaded_modules_output_may_change_in_place(device, tmp_path):
    # ReLU(inplace=True) after an offloaded Linear raised torch's "view
    # created inside a custom Function ... modified inplace".
    ref, _ = _grads(_mlp(inplace=True), None, tmp_path)
    got, h = _grads(_mlp(inplace=True), device, tmp_path)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    h.remove()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_frozen_params_are_released_after_their_backward(device, tmp_path):
    # A LoRA-like model: the base layers frozen. They have no gradient to
    # release them, and stayed live after backward: the whole model.
    ref, _ = _grads(_mlp(frozen=True), None, tmp_path)
    got, h = _grads(_mlp(frozen=True), device, tmp_path)
    assert h.live_numel() == 0
    assert len(got) == len(ref) == 2 and all(torch.equal(a, b) for a, b in zip(got, ref))
    h.remove()


def test_a_model_cast_after_the_offload_is_refused_with_the_fix(tmp_path):
    m = Net()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    m.to(torch.float64)
    with pytest.raises(RuntimeError, match="cast the model before offload_parameters"):
        m(torch.zeros(1, 3, dtype=torch.long))
    # A move to the device it is on changes nothing; a fetch follows the
    # param's device (HF Trainer moves the model after the offload).
    m2 = Net()
    h2 = tzt.offload_parameters(m2, "cpu", param_persistence_threshold=100)
    m2.to("cpu")
    assert m2(torch.zeros(1, 3, dtype=torch.long)).device.type == "cpu"
    h2.remove()
    del h


def test_a_dropped_model_takes_its_offload_with_it(tmp_path):
    import gc
    import weakref

    m = Net()
    h = tzt.offload_parameters(m, "nvme", nvme_path=tmp_path / "p", param_persistence_threshold=100)
    assert list((tmp_path / "p").iterdir())
    r = weakref.ref(h)
    del m, h
    gc.collect()
    assert r() is None, "the offload outlived its model"
    assert list((tmp_path / "p").iterdir()) == []


def test_the_optimizer_writes_only_its_range_of_an_nvme_param(tmp_path):
    # A param cut into several optimizer sub-groups was read and rewritten
    # whole for each of them.
    def run(sub_group_size, where):
        m = Net()
        h = tzt.offload_parameters(m, "nvme", nvme_path=tmp_path / where, param_persistence_threshold=100)
        opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none", sub_group_size=sub_group_size)
        g = torch.Generator().manual_seed(1)
        fetched = []
        for _ in range(3):
            ids = torch.randint(0, 50, (4, 16), generator=g)
            torch.nn.functional.cross_entropy(m(ids).reshape(-1, 50), ids.reshape(-1)).backward()
            before = h.fetched_bytes
            opt.step()
            fetched.append(h.fetched_bytes - before)
            opt.zero_grad()
        with h.gathered():
            out = [p.detach().clone() for p in m.parameters()]
        h.remove()
        return out, fetched

    whole, _ = run(10**9, "a")
    cut, fetched = run(1000, "b")
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    assert fetched == [0, 0, 0], fetched


_NESTED_OUTPUTS = r"""
import collections, sys, torch, tierzero.torch as tzt

device, path = sys.argv[1], sys.argv[2]


def grads(offload, make, loss):
    torch.manual_seed(5)
    m = make()
    if offload:
        h = tzt.offload_parameters(m, device, nvme_path=path, param_persistence_threshold=0)
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(6), requires_grad=True)
    loss(m(x)).backward()
    got = [x.grad] + [p.grad for p in m.parameters()]
    if offload:
        h.remove()
    return got


NT = collections.namedtuple("NT", "y z")


class Pair(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        return NT(y, [{"deep": (y * 2,)}])


cases = {
    # (out, (h, c)): the gradient through h alone reached the LSTM's
    # backward with its params released, and the process crashed.
    "lstm h": (lambda: torch.nn.LSTM(16, 32, batch_first=True), lambda o: o[1][0].sum()),
    "lstm c": (lambda: torch.nn.LSTM(16, 32, batch_first=True), lambda o: o[1][1].square().sum()),
    "namedtuple, list, dict": (lambda: Pair(16, 16), lambda o: o.z[0]["deep"][0].sum() + o.y.sum()),
}
for name, (make, loss) in cases.items():
    ref, got = grads(False, make, loss), grads(True, make, loss)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got)), name
    print("ok", name)
"""


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_grads_through_nested_outputs_match(device, tmp_path):
    # A subprocess: the failure this guards against was a crash (SIGSEGV).
    import subprocess
    import sys

    script = tmp_path / "nested.py"
    script.write_text(_NESTED_OUTPUTS)
    r = subprocess.run(
        [sys.executable, str(script), device, str(tmp_path / "p")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.count("ok ") == 3, r.stdout


class _ReadsChildWeight(torch.nn.Module):
    """A head tied by reading the embedding's weight without calling it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.emb = torch.nn.Embedding(300, 64)

    def forward(self, ids):
        return torch.nn.functional.linear(self.emb(ids), self.emb.weight).logsumexp(-1).sum()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_modules_that_read_their_childrens_params_fetch_them_all(device, tmp_path):
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj,
    # a Transformer layer's fast path (eval, no grad) reads every child's:
    # both failed with "mat2 must be a matrix, got 1-D tensor".
    def make():
        torch.manual_seed(7)
        return torch.nn.Sequential(
            torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
            torch.nn.TransformerDecoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
        )

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(8))

    def run(m):
        enc, dec = m
        loss = dec(enc(x), x).square().sum()
        loss.backward()
        with torch.no_grad():
            m.eval()
            ev = dec(enc(x), x)
            m.train()
        return [loss.detach(), ev] + [p.grad for p in m.parameters()]

    ref = run(make())
    m = make()
    h = tzt.offload_parameters(m, device, nvme_path=tmp_path / "p", param_persistence_threshold=0)
    got = run(m)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    h.remove()
    # Another such module is named with whole_modules.
    ids = torch.tensor([[1, 2, 299]])
    ref = _ReadsChildWeight()(ids)
    m = _ReadsChildWeight()
    h = tzt.offload_parameters(m, device, nvme_path=tmp_path / "q", param_persistence_threshold=0)
    with pytest.raises(RuntimeError):
        m(ids)
    h.remove()
    h = tzt.offload_parameters(
        m, device, nvme_path=tmp_path / "q", param_persistence_threshold=0, whole_modules=(_ReadsChildWeight,)
    )
    assert torch.equal(m(ids), ref)
    h.remove()


def test_a_modules_input_containers_are_not_changed(tmp_path):
    # The frozen params' release wraps the inputs: a list passed in was
    # changed in place, the caller's list then held the wrapper's output.
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(300, 300)
            self.lin.requires_grad_(False)

        def forward(self, xs):
            return self.lin(xs[0])

    m = Frozen()
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=0)
    x = torch.randn(2, 300, requires_grad=True)
    xs = [x]
    m(xs).sum().backward()
    assert xs[0] is x and x.grad is not None
    h.remove()


def test_a_params_file_whose_lock_is_free_is_reclaimed_whatever_its_pid(tmp_path, monkeypatch):
    # Pids are reused: a container restarted runs its trainer as pid 1
    # again, and its dead predecessor's model-sized file, named with pid 1,
    # was spared as this process's own, for good (as was a file named with
    # any live process's pid). A free lock means stale; spared are the
    # files this process holds and a file its pid's process has open.
    import fcntl
    import os
    import subprocess
    import sys

    import tierzero.offload as offload

    d = tmp_path / "p"
    d.mkdir()
    # A live process that holds one file named with its pid open, unlocked
    # (an offload on NFS, whose flock is a POSIX lock: closing another fd
    # of the file let it go), and not the other.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "p = os.path.join(sys.argv[1], f'tierzero-params-{os.getpid()}-cafe.bin')\n"
            "open(p, 'wb').write(b'x')\n"
            "fd = os.open(p, os.O_RDONLY)\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n",
            str(d),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        open_in_child = d / f"tierzero-params-{child.pid}-cafe.bin"
        predecessor = d / f"tierzero-params-{os.getpid()}-dead.bin"  # this pid's, a killed run's
        reused = d / f"tierzero-params-{child.pid}-beef.bin"  # a live pid's, not its file
        for f in (predecessor, reused):
            f.write_bytes(b"x" * 10)
        with pytest.warns(UserWarning, match=r"removed 2 file\(s\)") as got:
            mine = tzt.offload_parameters(Net(), "nvme", nvme_path=d, param_persistence_threshold=100)
        assert str(predecessor) in str(got[0].message) and str(reused) in str(got[0].message)
        names = {p.name for p in d.iterdir()}
        assert open_in_child.name in names and predecessor.name not in names and reused.name not in names
        (held,) = names - {open_in_child.name}
        # Where this process's own lock does not stop its reclaim (flock a
        # POSIX lock, as NFS makes it), its own live file is spared as its
        # own, and a predecessor's still goes.
        monkeypatch.setattr(
            offload,
            "fcntl",
            types.SimpleNamespace(flock=lambda fd, op: None, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB),
        )
        predecessor.write_bytes(b"x" * 10)
        with pytest.warns(UserWarning, match=r"removed 1 file\(s\)"):
            other = tzt.offload_parameters(Net(), "nvme", nvme_path=d, param_persistence_threshold=100)
        names = {p.name for p in d.iterdir()}
        assert held in names and open_in_child.name in names and predecessor.name not in names
        assert len(names) == 3  # the other offload's file besides
        mine.remove()
        other.remove()
        assert {p.name for p in d.iterdir()} == {open_in_child.name}
    finally:
        child.stdin.close()
        child.wait()

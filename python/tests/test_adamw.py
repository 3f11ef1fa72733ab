"""tierzero.torch.AdamW against torch.optim.AdamW(foreach=False)."""

import hashlib

import pytest

torch = pytest.importorskip("torch")
import tierzero.torch as tzt  # noqa: E402

SIZES = [0, 1, 7, 15, 1023, 4097, 10**6]


def make_params(sizes=SIZES, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in sizes]


def groups_of(ps):
    # HF's decay / no-decay split, with a group-specific lr.
    return [
        {"params": ps[: len(ps) // 2], "weight_decay": 0.1},
        {"params": ps[len(ps) // 2 :], "weight_decay": 0.0, "lr": 2e-3},
    ]


def train(make_opt, steps, ps=None, seed=1, start=0, opt=None):
    ps = make_params() if ps is None else ps
    opt = make_opt(groups_of(ps)) if opt is None else opt
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    if start:
        sched.load_state_dict({**sched.state_dict(), "last_epoch": start})
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] / (1 + 0.1 * start)
    g = torch.Generator().manual_seed(seed)
    for _ in range(start):
        for p in ps:
            torch.randn(p.shape, generator=g)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
        sched.step()
    return ps, opt


def rel_err(got, ref):
    return max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, ref) if b.numel())


def weight_hash(ps):
    h = hashlib.sha256()
    for p in ps:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def torch_adamw(gr):
    return torch.optim.AdamW(gr, lr=1e-3, foreach=False)


def tz(offload, tmp_path, **kw):
    nvme = tmp_path / "nvme" if tmp_path is not None else None
    return lambda gr: tzt.AdamW(gr, lr=1e-3, offload=offload, nvme_path=nvme, **kw)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_matches_torch_after_1_and_100_steps(offload, tmp_path):
    ref, _ = train(torch_adamw, 1)
    got, _ = train(tz(offload, tmp_path, sub_group_size=5000), 1)
    assert rel_err(got, ref) <= 1e-6
    ref, _ = train(torch_adamw, 100)
    got, opt = train(tz(offload, tmp_path, sub_group_size=300_000), 100)
    assert rel_err(got, ref) <= 1e-5
    if offload == "nvme":
        read, written = opt.nvme_bytes()
        assert read > 0 and written > 0


def test_same_weights_for_every_tier_and_sub_group_size(tmp_path):
    hashes = set()
    for offload, sgs in [("none", 10**9), ("cpu", 4096), ("nvme", 10**9), ("nvme", 1000), ("nvme", 4097)]:
        ps, _ = train(tz(offload, tmp_path / f"{offload}{sgs}", sub_group_size=sgs), 5)
        hashes.add(weight_hash(ps))
    assert len(hashes) == 1


def test_bf16_params_get_the_rounded_master(tmp_path):
    ps = make_params([1023, 4097], torch.bfloat16)
    masters = [p.detach().float().clone() for p in ps]
    opt = tzt.AdamW([{"params": ps}], lr=1e-2, offload="nvme", nvme_path=tmp_path)
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    ref_opt = torch.optim.AdamW([{"params": ref}], lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p, r in zip(ps, ref):
            grad = torch.randn(p.shape, generator=g)
            p.grad = grad.to(torch.bfloat16)
            r.grad = grad.to(torch.bfloat16).float()
        opt.step()
        ref_opt.step()
    for p, r in zip(ps, ref):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    sd = opt.state_dict()
    assert all("master" in st for st in sd["state"].values())


def test_resume_from_state_dict_and_checkpoint_is_bit_identical(tmp_path):
    make = tz("nvme", tmp_path / "a", sub_group_size=100_000)
    whole, _ = train(make, 100)
    half, opt = train(make, 50)
    sd = opt.state_dict()
    opt.save_checkpoint(tmp_path / "opt.ckpt")
    saved = [p.detach().clone() for p in half]
    # Resume from torch's state_dict.
    ps = [torch.nn.Parameter(t.clone()) for t in saved]
    opt2 = tz("nvme", tmp_path / "b", sub_group_size=100_000)(groups_of(ps))
    opt2.load_state_dict(sd)
    resumed, _ = train(None, 50, ps=ps, start=50, opt=opt2)
    assert weight_hash(resumed) == weight_hash(whole)
    # Resume from the streaming checkpoint, into another tier.
    ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in saved]
    opt3 = tz("cpu", tmp_path / "c", sub_group_size=100_000)(groups_of(ps))
    opt3.load_checkpoint(tmp_path / "opt.ckpt")
    resumed, _ = train(None, 50, ps=ps, start=50, opt=opt3)
    assert weight_hash(resumed) == weight_hash(whole)


def test_state_dict_is_torch_format():
    ps, opt = train(tz("none", None), 3)
    ref, ref_opt = train(torch_adamw, 3)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for k in rsd["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = sd["state"][k][key], rsd["state"][k][key]
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # lerp vs fma rounding
        assert float(sd["state"][k]["step"]) == float(rsd["state"][k]["step"]) == 3.0
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in rsd["param_groups"]]
    # torch's AdamW takes it.
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    torch.optim.AdamW(groups_of(fresh), lr=1e-3, foreach=False).load_state_dict(sd)


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_state_before_the_first_step_is_empty_as_torchs(offload, tmp_path):
    # accelerate's prepare() moves the state dict to the device and loads it
    # back: a model that has not stepped must not materialise its state.
    ps = [torch.nn.Parameter(torch.randn(1000, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(10))]
    opt = tzt.AdamW(ps, offload=offload, nvme_path=tmp_path, sub_group_size=300)
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps])
    sd = opt.state_dict()
    assert sd["state"] == ref.state_dict()["state"] == {}
    before = [p.detach().clone() for p in ps]
    opt.load_state_dict(sd)
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.state_dict()["state"]) == 2


def test_a_param_group_added_after_construction_is_refused():
    opt = tzt.AdamW([torch.nn.Parameter(torch.zeros(3))], offload="none")
    with pytest.raises(NotImplementedError, match="param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    # Groups given at construction are fine.
    tzt.AdamW([{"params": [torch.nn.Parameter(torch.zeros(3))]}, {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}], offload="none")


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_frozen_param_is_not_stepped_until_it_has_a_gradient(offload, tmp_path):
    # Lightning's BaseFinetuning: every param given at construction, the
    # frozen ones with requires_grad=False, unfrozen later. While frozen, a
    # param is left alone as torch leaves it (it was stepped with a zero
    # gradient beside the trainable params of its sub-group, so weight
    # decay shrank it every step); once it has gradients it is stepped as
    # torch steps it. bf16 params: not the in-place path, so the params
    # share one sub-group but for the frozen one's.
    def params():
        torch.manual_seed(3)
        return [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (5, 7, 9)]

    ours, ref = params(), params()
    for ps in (ours, ref):
        ps[1].requires_grad_(False)
    opt = tzt.AdamW(ours, lr=0.1, weight_decay=0.1, offload=offload, nvme_path=tmp_path / "nvme")
    torch_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=False)
    frozen = ours[1].detach().clone()
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        if step == 2:
            for ps in (ours, ref):
                ps[1].requires_grad_(True)
        for a, b in zip(ours, ref):
            if a.requires_grad:
                a.grad = torch.randn(a.shape, generator=g).to(a.dtype)
                b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
        if step < 2:
            assert torch.equal(ours[1], frozen), f"step {step}: a frozen param moved"
    assert not torch.equal(ours[1], frozen), "the unfrozen param was never stepped"
    for a, b in zip(ours, ref):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2, (a, b)


@pytest.mark.parametrize("offload,dtype", [("cpu", torch.bfloat16), ("nvme", torch.float32)])
def test_a_param_frozen_after_construction_stays_as_torch_leaves_it(offload, dtype, tmp_path):
    # In a sub-group shared with params that have gradients, its None
    # gradient was a zero one: momentum kept moving it (0.02 after three
    # steps at lr 1e-2), where torch's AdamW leaves it alone.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(dtype)
    ref.load_state_dict(m.state_dict())
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload=offload, nvme_path=tmp_path)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 8, dtype=dtype)
    for step in range(6):
        if step == 3:
            m[0].requires_grad_(False)
            ref[0].requires_grad_(False)
            frozen = m[0].weight.detach().clone()
        for mm, o in ((m, opt), (ref, ro)):
            o.zero_grad()
            mm(x).float().pow(2).sum().backward()
            o.step()
    assert torch.equal(m[0].weight.detach(), frozen)
    # The rest as torch steps it (bf16: the fp32 master's one rounding).
    tol = 2e-3 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(m[1].weight.float(), ref[1].weight.float(), rtol=0, atol=tol)


def test_a_step_that_raised_leaves_the_step_count(tmp_path):
    # A sparse gradient is refused before the kernel runs; the next step
    # is the param's first, as torch's would be (the count went up anyway,
    # so its bias correction was the second step's).
    ours = [torch.nn.Parameter(torch.ones(6))]
    ref = [torch.nn.Parameter(torch.ones(6))]
    opt = tzt.AdamW(ours, lr=0.1, offload="nvme", nvme_path=tmp_path / "nvme")
    ours[0].grad = torch.sparse_coo_tensor([[0]], [1.0], (6,))
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    torch_opt = torch.optim.AdamW(ref, lr=0.1, foreach=False)
    for p in (ours[0], ref[0]):
        p.grad = torch.full((6,), 0.5)
    opt.step()
    torch_opt.step()
    assert torch.allclose(ours[0], ref[0], rtol=0, atol=1e-6), (ours[0], ref[0])


def test_params_changed_after_construction_are_named():
    # The in-place path is chosen at construction (fp32 CPU params); a
    # model cast (or moved to a GPU) since failed in the kernel's import.
    p = torch.nn.Parameter(torch.ones(4))
    opt = tzt.AdamW([p], offload="none")
    p.data = p.data.to(torch.bfloat16)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="build the optimizer after moving the model"):
        opt.step()


@pytest.mark.parametrize("sub_group_size", [10**9, 3000])
def test_params_changed_between_steps_are_stepped_as_they_are(tmp_path, sub_group_size):
    # The nvme tier keeps its own fp32 master: a change to the params after
    # construction (a checkpoint loaded, a clamp_, new .data) was written
    # over by the next step's stale master. torch steps the params as they
    # are, moments kept.
    def changes(ps, step):
        with torch.no_grad():
            if step == 0:
                for p in ps:
                    p.fill_(5.0)  # pretrained weights loaded after the optimizer
            elif step == 2:
                ps[4].clamp_(-0.5, 0.5)  # a param split over sub-groups at 3000
            elif step == 3:
                ps[5].data = torch.full_like(ps[5], -2.0)  # new storage

    def run(make_opt):
        ps = make_params()
        opt = make_opt(groups_of(ps))
        g = torch.Generator().manual_seed(4)
        for step in range(5):
            changes(ps, step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return ps

    ref = run(torch_adamw)
    got = run(tz("nvme", tmp_path, sub_group_size=sub_group_size))
    assert rel_err(got, ref) < 1e-6
    # bf16 params on the cpu tier: their master follows the change too.
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = tzt.AdamW([p], lr=1e-3, weight_decay=0.0, offload="cpu")
    with torch.no_grad():
        p.fill_(5.0)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.equal(p.detach(), torch.full_like(p, 5.0 - 1e-3))


@pytest.mark.parametrize("offload,dtype", [("nvme", torch.float32), ("cpu", torch.bfloat16)])
def test_a_save_keeps_params_changed_since_their_last_step(offload, dtype, tmp_path):
    # The master of a param changed after its last step (a frozen weight
    # loaded after the optimizer was built, a weight edited) was saved as
    # it was, and a load wrote those old values over the param.
    torch.manual_seed(0)
    pre = torch.nn.Linear(4, 4).to(dtype).state_dict()
    m = torch.nn.Linear(4, 4).to(dtype)
    m.weight.requires_grad_(False)
    opt = tzt.AdamW(m.parameters(), offload=offload, nvme_path=tmp_path / "nvme")
    m(torch.randn(2, 4, dtype=dtype)).sum().backward()
    opt.step()
    m.load_state_dict(pre)  # after a step: the bias's sub-group has a master
    opt.save_checkpoint(tmp_path / "opt.bin")
    opt.load_checkpoint(tmp_path / "opt.bin")
    assert torch.equal(m.weight, pre["weight"])
    opt.load_state_dict(opt.state_dict())
    assert torch.equal(m.weight, pre["weight"])


def test_weights_loaded_into_offloaded_params_after_the_optimizer_are_stepped(tmp_path):
    # model.load_state_dict() writes an offloaded param's home; the
    # optimizer's master, taken before, wrote its older values back at
    # the next step (max |w - loaded| was 0.1, the init's scale, not lr).
    torch.manual_seed(0)
    pre = torch.nn.Linear(400, 300).state_dict()
    m = torch.nn.Linear(400, 300)
    tzt.offload_parameters(m, "cpu")
    opt = tzt.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, offload="nvme", nvme_path=tmp_path)
    m.load_state_dict(pre)
    m(torch.randn(2, 400)).sum().backward()
    opt.step()
    moved = (m.state_dict()["weight"] - pre["weight"]).abs().max().item()
    assert moved <= 1e-3 + 1e-6, moved


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_change_made_while_gathered_is_stepped_from(offload, tmp_path):
    # A clamp or re-init inside handle.gathered() went to the param's home
    # but not to the optimizer's master: the next step wrote the master's
    # older values back (max |w| was 0.25 after zeroing and one lr-1e-3 step).
    torch.manual_seed(0)
    m = torch.nn.Linear(400, 300)
    h = tzt.offload_parameters(m, offload, nvme_path=tmp_path / "p")
    opt = tzt.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0, offload="nvme", nvme_path=tmp_path / "o")
    m(torch.randn(2, 400)).sum().backward()
    opt.step()
    opt.zero_grad()
    with h.gathered():
        with torch.no_grad():
            m.weight.zero_()
    m(torch.randn(2, 400)).sum().backward()
    opt.step()
    # One step from zero: about lr (Adam's second step may pass it a
    # little), nowhere near the init's 0.05.
    moved = m.state_dict()["weight"].abs().max().item()
    assert moved <= 2e-3, moved
    # Gathered only to read: nothing is re-read (a bf16 home would round
    # the master), the weights are the ones the optimizer wrote.
    before = m.state_dict()["weight"].clone()
    with h.gathered():
        pass
    assert torch.equal(m.state_dict()["weight"], before)
    h.remove()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_step_marks_the_params_written_as_torch_does(offload, tmp_path):
    # The kernel writes the params through their memory: torch's check of
    # a graph that saved them before the step did not fire, and backward
    # ran with the new values.
    # (nvme: one fp32 param, a sub-group the kernel writes in place too.)
    lin = torch.nn.Linear(4, 4, bias=offload != "nvme")
    opt = tzt.AdamW(lin.parameters(), lr=0.1, offload=offload, nvme_path=tmp_path)
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()
    y = lin(x).pow(2).sum()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # And the optimizer does not take its own write for a user's change:
    # its second step matches torch's, stepped alike.
    torch.manual_seed(1)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    mine = tzt.AdamW(a.parameters(), lr=0.1, offload=offload, nvme_path=tmp_path / "b")
    ref = torch.optim.AdamW(b.parameters(), lr=0.1)
    for _ in range(3):
        for m, o in ((a, mine), (b, ref)):
            o.zero_grad()
            m(x.detach()).pow(2).sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_state_dict_of_other_shapes_is_refused():
    # Another model's moments were sliced to this one's size and stepped.
    a = torch.nn.Linear(8, 8)
    opt = tzt.AdamW(a.parameters(), lr=1e-3, offload="cpu")
    a(torch.randn(2, 8)).sum().backward()
    opt.step()
    b = torch.nn.Linear(4, 8)
    other = tzt.AdamW(b.parameters(), lr=5e-3, offload="cpu")
    with pytest.raises(ValueError, match=r"'exp_avg' has 64 elements .* param of shape \(8, 4\)"):
        other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["lr"] == 5e-3  # nothing loaded


def test_a_checkpoint_keeps_each_piece_s_step_count(tmp_path):
    # A param over two sub-groups whose gradient was None while the other
    # sub-group's param had one: sub-groups [0, 3] were loaded as [3, 3]
    # (one count per param), and the resumed run moved off the uninterrupted
    # one by 0.07. Each piece has its own count: a's pieces 2 (the steps it
    # had a gradient), b's 5.
    def run(resume):
        torch.manual_seed(0)
        a, b = [torch.nn.Parameter(torch.randn(n)) for n in (15, 5)]
        opt = tzt.AdamW([a, b], lr=0.1, offload="nvme", nvme_path=tmp_path / "a", sub_group_size=10)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            a.grad, b.grad = None, torch.randn(5, generator=g)
            opt.step()
        if resume:
            opt.save_checkpoint(tmp_path / "opt.bin")
            del opt
            opt = tzt.AdamW([a, b], lr=0.1, offload="nvme", nvme_path=tmp_path / "b", sub_group_size=10)
            opt.load_checkpoint(tmp_path / "opt.bin")
        for _ in range(2):
            a.grad, b.grad = torch.randn(15, generator=g), torch.randn(5, generator=g)
            opt.step()
        return [s.steps for s in opt._subgroups], torch.cat([a.detach(), b.detach()])

    (steps, ref), (resumed_steps, got) = run(False), run(True)
    assert steps == resumed_steps == [[2], [2, 5]]
    assert torch.equal(got, ref)


def test_a_checkpoint_loads_only_into_the_same_param_groups(tmp_path):
    # The same total in other groups was read across them (each group got
    # the other's values and hyper-parameters); a truncated file is refused
    # before anything is loaded (the sub-groups before the cut were); a
    # tensor lr is saved as its number (it was a JSON TypeError).
    a, b = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2))
    opt = tzt.AdamW([{"params": [a]}, {"params": [b], "lr": torch.tensor(0.5)}], offload="nvme", nvme_path=tmp_path / "a")
    a.grad, b.grad = torch.ones(6), torch.ones(2)
    opt.step()
    opt.save_checkpoint(tmp_path / "opt.bin")
    a2, b2 = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2))
    swapped = tzt.AdamW([{"params": [b2]}, {"params": [a2]}], offload="nvme", nvme_path=tmp_path / "b")
    with pytest.raises(ValueError, match=r"param groups of \[6, 2\] elements, this optimizer's are \[2, 6\]"):
        swapped.load_checkpoint(tmp_path / "opt.bin")
    data = (tmp_path / "opt.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-8])
    same = tzt.AdamW([{"params": [a2]}, {"params": [b2]}], offload="nvme", nvme_path=tmp_path / "c")
    before = a2.detach().clone()
    with pytest.raises(ValueError, match="truncated"):
        same.load_checkpoint(tmp_path / "cut.bin")
    assert torch.equal(a2.detach(), before)
    # A damaged header is a ValueError naming the file (a huge length was
    # a MemoryError, bytes that are not JSON a JSONDecodeError).
    n = int.from_bytes(data[8:16], "little")
    for bad in [data[:8] + (1 << 60).to_bytes(8, "little") + data[16:], data[:16] + b"[" * n + data[16 + n:]]:
        (tmp_path / "bad.bin").write_bytes(bad)
        with pytest.raises(ValueError, match="bad.bin: damaged"):
            same.load_checkpoint(tmp_path / "bad.bin")
    assert torch.equal(a2.detach(), before)
    same.load_checkpoint(tmp_path / "opt.bin")
    assert torch.equal(a2.detach(), a.detach())
    assert same.param_groups[1]["lr"] == 0.5


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    opt = tzt.AdamW([torch.nn.Parameter(torch.ones(8))], offload="nvme", nvme_path=tmp_path / "nvme")
    out = tmp_path / "out"
    out.mkdir()

    class Failing:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def read_state(self, *args):
            raise OSError("disk full")

    monkeypatch.setattr(opt, "_native", Failing(opt._native))
    with pytest.raises(OSError, match="disk full"):
        opt.save_checkpoint(out / "opt.bin")
    assert list(out.iterdir()) == []


def test_bad_arguments_raise():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="amsgrad"):
        tzt.AdamW(p, amsgrad=True, offload="none")
    with pytest.raises(ValueError, match="nvme_path"):
        tzt.AdamW(p, offload="nvme")
    with pytest.raises(ValueError, match="offload"):
        tzt.AdamW(p, offload="gpu")
    with pytest.raises(ValueError, match="learning rate"):
        tzt.AdamW(p, lr=-1.0, offload="none")
    # Named (threads=0 failed every step; negatives were a bare OverflowError).
    for kw in (dict(threads=0), dict(threads=-1), dict(pinned_budget_bytes=-1)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            tzt.AdamW(p, offload="cpu", **kw)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"shape \(8, 3, 3, 3\).*contiguous_format"):
        tzt.AdamW(conv.parameters(), offload="cpu")


def test_a_bad_hyper_parameter_steps_nothing(tmp_path):
    # On the nvme path a later group's bad lr raised after the groups
    # before it had stepped.
    a, b = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(2))
    opt = tzt.AdamW([{"params": [a]}, {"params": [b]}], offload="nvme", nvme_path=tmp_path)
    opt.param_groups[1]["lr"] = -1
    a.grad, b.grad = torch.ones(6), torch.ones(2)
    before = a.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] = -1.0"):
        opt.step()
    assert torch.equal(a.detach(), before)


def test_pinned_budget_too_small_names_the_numbers(tmp_path):
    p = [torch.nn.Parameter(torch.zeros(10_000))]
    with pytest.raises(ValueError, match=r"needs 9 buffers of 40960 bytes.*at least 368640"):
        tzt.AdamW(p, offload="nvme", nvme_path=tmp_path, pinned_budget_bytes=4096)


def test_an_os_failure_of_the_state_s_files_is_an_oserror(tmp_path):
    # As tierzero.aio's are: `except OSError` catches it, errno and all
    # (it was a RuntimeError with the code in its text).
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError) as e:
        tzt.AdamW([torch.nn.Parameter(torch.zeros(1000))], offload="nvme", nvme_path=tmp_path / "file")
    assert e.value.errno is not None, e.value


def test_ds_config_supplies_the_offload(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "ds")},
        },
    }
    ps = make_params([4097])
    opt = tzt.AdamW(ps, ds_config=cfg)
    assert opt.offload == "nvme"
    assert "5 sub-groups" in opt.plan()
    assert str(tmp_path / "ds") in opt.plan()


def test_ds_config_of_a_multi_gpu_run_with_a_scheduler_is_read(tmp_path):
    # A config written for 8 GPUs (train_batch_size 64 = 8 x 1 x 8 ranks),
    # with a scheduler whose total is "auto" and another optimizer's
    # block: the batch, the scheduler and the optimizer are the trainer's
    # business, not this optimizer's, so none refuses the config.
    cfg = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Lamb", "params": {"lr": 7e-3}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "ds")},
        },
    }
    with pytest.warns(UserWarning, match="optimizer.type is 'Lamb'.*params are not used"):
        opt = tzt.AdamW(make_params([4097]), ds_config=cfg)
    assert opt.offload == "nvme"
    assert "5 sub-groups" in opt.plan()
    assert opt.param_groups[0]["lr"] == 1e-3  # torch's default, not Lamb's
    assert opt.param_groups[0]["weight_decay"] == 1e-2


def test_ds_config_optimizer_block_supplies_the_hyper_parameters(tmp_path):
    # The block's lr, betas, eps and weight_decay were ignored: the run
    # trained at the constructor's defaults, silently.
    import warnings

    params = {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.0}
    cfg = {
        "optimizer": {"type": "adamw", "params": params},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        opt = tzt.AdamW(groups_of(make_params()), ds_config=cfg)
    g0, g1 = opt.param_groups
    assert (g0["lr"], tuple(g0["betas"]), g0["eps"]) == (3e-5, (0.9, 0.95), 1e-6)
    assert g0["weight_decay"] == 0.1 and g1["lr"] == 2e-3  # a group's own values stay
    # It steps as torch's AdamW with those values.
    ref, _ = train(lambda gr: torch.optim.AdamW(gr, lr=3e-5, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.0, foreach=False), 3)
    got, _ = train(lambda gr: tzt.AdamW(gr, ds_config=cfg), 3)
    assert rel_err(got, ref) <= 1e-6
    # "auto" is the keyword's value (as HF fills it with TrainingArguments'),
    # else HF's default (weight_decay 0.0).
    auto = {**cfg, "optimizer": {"type": "Adam", "params": {k: "auto" for k in params}}}
    opt = tzt.AdamW(make_params([10]), lr=5e-4, ds_config=auto)
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == (5e-4, (0.9, 0.999), 1e-8, 0.0)
    # A block that leaves weight_decay out gets DeepSpeed's default: 0
    # (its CPU and fused Adam), 0.01 with torch_adam (torch's AdamW).
    for extra, wd in (({}, 0.0), ({"torch_adam": True}, 0.01)):
        bare = {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, **extra}}}
        assert tzt.AdamW(make_params([10]), ds_config=bare).param_groups[0]["weight_decay"] == wd
    # A keyword that differs from the block is refused naming both, as HF
    # Trainer refuses a config that differs from its TrainingArguments.
    with pytest.raises(ValueError, match=r"optimizer.params.lr.* in the config but .* was given"):
        tzt.AdamW(make_params([10]), lr=1e-4, ds_config=cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value given twice: nothing to say
        tzt.AdamW(make_params([10]), lr=3e-5, betas=(0.9, 0.95), ds_config=cfg)


@pytest.mark.parametrize(
    "block, match",
    [
        ({"type": "AdamW", "params": {"amsgrad": True}}, "optimizer.params.amsgrad"),
        ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction is false"),
        ({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, "adam_w_mode is false with a weight decay of 0.1"),
    ],
)
def test_ds_config_optimizer_variants_it_does_not_run_are_refused(block, match):
    cfg = {"optimizer": block, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match=match):
        tzt.AdamW(make_params([10]), ds_config=cfg)
    # Adam with L2 and no weight decay is AdamW.
    cfg["optimizer"] = {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0}}
    assert tzt.AdamW(make_params([10]), ds_config=cfg).param_groups[0]["weight_decay"] == 0


def test_ds_config_gradient_clipping_is_warned_about():
    # DeepSpeed's engine clips; an optimizer cannot: the config's clipping
    # was dropped without a word.
    cfg = {"gradient_clipping": 0.5, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.warns(UserWarning, match=r"gradient_clipping is 0.5.*max_grad_norm=0.5.*clip_grad_norm_"):
        tzt.AdamW(make_params([10]), ds_config=cfg)
    import warnings

    for clip in ("auto", 0):  # HF's max_grad_norm, or no clipping: nothing to say
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tzt.AdamW(make_params([10]), ds_config={**cfg, "gradient_clipping": clip})


def _child_holding_an_optimizer(path, env):
    """A process that builds an NVMe AdamW at ``path`` under ``env`` and
    holds it until its stdin closes; returns it once built."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch, tierzero.torch as tzt\n"
        f"o = tzt.AdamW([torch.nn.Parameter(torch.ones(1000))], offload='nvme', nvme_path={str(path)!r})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, **env},
    )
    assert child.stdout.readline().strip() == "ready"
    return child


def test_ranks_sharing_an_nvme_path_get_a_directory_each(tmp_path, monkeypatch):
    # DeepSpeed's nvme_path is one per node, each rank under it; rank 1
    # was refused ("locked by another tierzero process") where rank 0
    # held the directory.
    import os

    child = _child_holding_an_optimizer(tmp_path, {"RANK": "0", "WORLD_SIZE": "2"})
    try:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        opt = tzt.AdamW(make_params([4097]), offload="nvme", nvme_path=tmp_path)
        assert str(tmp_path / "rank1") in opt.plan()
        assert (tmp_path / "rank0" / "tierzero").is_dir() and (tmp_path / "rank1" / "tierzero").is_dir()
        assert not (tmp_path / "tierzero").exists()
        # A killed run's file in this rank's directory is reclaimed there.
        del opt
        stale = tmp_path / "rank1" / "tierzero" / f"swap-{_dead_pid()}-0-0.tzswap"
        stale.parent.mkdir(exist_ok=True)
        stale.write_bytes(b"x")
        opt = tzt.AdamW(make_params([4097]), offload="nvme", nvme_path=tmp_path)
        assert not stale.exists()
        # Without RANK the rank's directory is unknown: said, not guessed.
        monkeypatch.delenv("RANK")
        with pytest.raises(ValueError, match="WORLD_SIZE is 2 and RANK is not set"):
            tzt.AdamW(make_params([10]), offload="nvme", nvme_path=tmp_path)
        # One process: nvme_path itself, as before.
        monkeypatch.setenv("WORLD_SIZE", "1")
        opt1 = tzt.AdamW(make_params([10]), offload="nvme", nvme_path=tmp_path / "one")
        assert (tmp_path / "one" / "tierzero").is_dir()
        del opt, opt1
    finally:
        child.stdin.close()
        child.wait()
    assert os.listdir(tmp_path / "rank0") == []  # the child's went with it


def _dead_pid():
    """The pid of a process that has exited."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_step_in_backward_equals_step_after(offload, tmp_path):
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 300), torch.nn.GELU(), torch.nn.Linear(300, 8)
        )

    results = []
    for in_backward in (False, True):
        m = mlp()
        opt = tzt.AdamW(m.parameters(), lr=1e-2, offload=offload, nvme_path=tmp_path / str(in_backward), sub_group_size=20_000, step_in_backward=in_backward)
        g = torch.Generator().manual_seed(5)
        for _ in range(5):
            x = torch.randn(16, 32, generator=g)
            loss = m(x).square().mean()
            loss.backward()
            if in_backward:
                assert all(p.grad is None for p in m.parameters())  # stepped and freed in backward
            opt.step()
            opt.zero_grad()
        results.append(weight_hash(list(m.parameters())))
    assert results[0] == results[1]


def test_bf16_moments_match_the_kernel_reference():
    """bf16 moments (offload="cpu", fp32 params): m and v computed in f32 and
    stored rounded to bf16, as tierzero's kernel does; against a float64
    reference of that rule over 20 steps."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4097))
    opt = tzt.AdamW([p], lr=1e-2, weight_decay=0.1, offload="cpu", moments_dtype=torch.bfloat16)
    ref = p.detach().double().clone()
    m = torch.zeros(4097, dtype=torch.float64)
    v = torch.zeros(4097, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    for t in range(1, 21):
        grad = torch.randn(4097, generator=g)
        p.grad = grad.clone()
        opt.step()
        gd = grad.double()
        ref *= 1 - 1e-2 * 0.1
        m32 = 0.9 * m + 0.1 * gd
        v32 = 0.999 * v + 0.001 * gd * gd
        ref -= 1e-2 / (1 - 0.9**t) * m32 / (v32.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
        m = m32.float().bfloat16().double()
        v = v32.float().bfloat16().double()
    assert ((p.detach().double() - ref).norm() / ref.norm()).item() < 1e-5
    sd = opt.state_dict()
    st = sd["state"][0]
    assert torch.equal(st["exp_avg"].bfloat16().float(), st["exp_avg"])  # stored as bf16


def test_bf16_moments_give_the_same_bits_on_every_tier(tmp_path):
    """bf16 moments in place (fp32 CPU params), in the engine's memory tier
    (bf16 params: a master copy) and on NVMe, at several sub-group sizes:
    the same weights and state; on NVMe a step moves 8 bytes of state per
    element each way, not 12; the streaming checkpoint and the state_dict
    resume bit for bit into another tier."""
    bf = torch.bfloat16

    def make(offload, sgs, name):
        return tz(offload, tmp_path / name, sub_group_size=sgs, moments_dtype=bf)

    hashes, states = set(), []
    for offload, sgs in [("cpu", 10**9), ("nvme", 10**9), ("nvme", 1000), ("nvme", 4097)]:
        ps, opt = train(make(offload, sgs, f"{offload}{sgs}"), 5)
        hashes.add(weight_hash(ps))
        states.append(opt.state_dict()["state"])
        if offload == "nvme":
            assert "bfloat16 m and v" in opt.plan()
    assert len(hashes) == 1
    for st in states[1:]:
        for k in st:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k][key], states[0][k][key])
    assert all(torch.equal(s["exp_avg"].bfloat16().float(), s["exp_avg"]) for s in states[1].values())
    # State I/O of one step over fp32 and bf16 moments.
    n = 1 << 16
    moved = {}
    for dt in (torch.float32, bf):
        p = torch.nn.Parameter(torch.randn(n))
        opt = tzt.AdamW([p], offload="nvme", nvme_path=tmp_path / f"io{dt}", moments_dtype=dt)
        r0, w0 = opt.nvme_bytes()
        p.grad = torch.randn(n)
        opt.step()
        r1, w1 = opt.nvme_bytes()
        moved[dt] = (r1 - r0, w1 - w0)
    assert moved[torch.float32] == (12 * n, 12 * n)
    assert moved[bf] == (8 * n, 8 * n)
    # bf16 params (a master copy) in the engine's memory tier and on NVMe.
    low = {}
    for offload in ("cpu", "nvme"):
        ps = make_params([1023, 4097], bf)
        opt = tzt.AdamW(ps, lr=1e-2, offload=offload, nvme_path=tmp_path / f"low{offload}", moments_dtype=bf)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(bf)
            opt.step()
        low[offload] = weight_hash(ps)
    assert low["cpu"] == low["nvme"]
    # Resume at step 3 of 6 from the checkpoint (NVMe into cpu) and the
    # state_dict (NVMe into NVMe).
    whole, _ = train(make("nvme", 4097, "w"), 6)
    half, opt = train(make("nvme", 4097, "h"), 3)
    opt.save_checkpoint(tmp_path / "bf.ckpt")
    sd = opt.state_dict()
    saved = [p.detach().clone() for p in half]
    ps = [torch.nn.Parameter(torch.zeros_like(t)) for t in saved]
    opt2 = make("cpu", 10**9, "r1")(groups_of(ps))
    opt2.load_checkpoint(tmp_path / "bf.ckpt")
    resumed, _ = train(None, 3, ps=ps, start=3, opt=opt2)
    assert weight_hash(resumed) == weight_hash(whole)
    ps = [torch.nn.Parameter(t.clone()) for t in saved]
    opt3 = make("nvme", 1000, "r2")(groups_of(ps))
    opt3.load_state_dict(sd)
    resumed, _ = train(None, 3, ps=ps, start=3, opt=opt3)
    assert weight_hash(resumed) == weight_hash(whole)


def test_in_place_many_equals_one_call_per_param():
    """One step_many call over every param (the in-place path's one call a
    step) gives each param the bits of its own adamw_step_inplace call, with
    per-item hyper-parameters; a refused item (overlap, bad dtype) steps
    nothing."""
    from tierzero import _native

    sizes = [0, 1, 7, 1023, 4097, (1 << 18) + 5]
    gen = torch.Generator().manual_seed(3)

    def state():
        return [
            [torch.randn(n, generator=gen) for _ in range(2)] + [torch.zeros(n), torch.zeros(n)] for n in sizes
        ]

    one = state()
    many = [[t.clone() for t in ts] for ts in one]
    cache = _native._InPlaceMoments([ts[2] for ts in many], [ts[3] for ts in many])
    hyper = [(k + 1, 1e-3 * (k + 1), 0.9, 0.99 - 0.001 * k, 1e-8, 0.01 * (k % 2)) for k in range(len(sizes))]
    for step in (1, 2):
        for (st, lr, b1, b2, eps, wd), (p, g, m, v) in zip(hyper, one):
            _native.adamw_step_inplace(st + step, lr, b1, b2, eps, wd, p, g, m, v, 2)
        cache.step_many(
            [(k, st + step, lr, b1, b2, eps, wd, p, g) for k, ((st, lr, b1, b2, eps, wd), (p, g, _, _))
             in enumerate(zip(hyper, many))],
            2,
        )
    for a, b in zip(one, many):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    before = [t.clone() for t in many[3]]
    p, g, m, v = many[3]
    with pytest.raises(ValueError, match="overlap"):
        # The same param twice: its memory would be stepped twice at once.
        cache.step_many([(3, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, p, g)] * 2)
    with pytest.raises(ValueError, match="item 1"):
        cache.step_many([(3, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, p, g), (4, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, p, g.double())])
    # An item's error keeps its type (it was rewrapped as a ValueError),
    # with the original as its cause.
    with pytest.raises(TypeError, match="item 0") as e:
        cache.step_many([42])
    assert isinstance(e.value.__cause__, TypeError)
    for x, y in zip(before, many[3]):
        assert torch.equal(x, y)


def test_in_place_moments_cache_equals_one_call_per_param():
    """_InPlaceMoments (the in-place path's m and v, imported once) steps
    every param as adamw_step_inplace does; a bad index, or a param that
    overlaps a cached moment, is refused before anything is stepped."""
    from tierzero import _native

    sizes = [1, 7, 4097, (1 << 18) + 5]
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen) for n in sizes]
    ref = [(p.clone(), torch.zeros(n), torch.zeros(n)) for p, n in zip(ps, sizes)]
    ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    cache = _native._InPlaceMoments(ms, vs)
    for step in (1, 2, 3):
        for k, (p, m, v) in enumerate(ref):
            _native.adamw_step_inplace(step, 1e-3 * (k + 1), 0.9, 0.999, 1e-8, 0.1, p, gs[k], m, v, 2)
        cache.step_many([(k, step, 1e-3 * (k + 1), 0.9, 0.999, 1e-8, 0.1, ps[k], gs[k]) for k in range(len(sizes))], 2)
    for k, (p, m, v) in enumerate(ref):
        assert torch.equal(p, ps[k]) and torch.equal(m, ms[k]) and torch.equal(v, vs[k])
    before = ps[0].clone()
    with pytest.raises(ValueError, match="sub-group 9 of 4"):
        cache.step_many([(0, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, ps[0], gs[0]), (9, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, ps[0], gs[0])])
    with pytest.raises(ValueError, match="overlap"):
        cache.step_many([(0, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, ps[0], gs[0]), (1, 4, 1e-3, 0.9, 0.999, 1e-8, 0.0, ms[1], gs[1])])
    assert torch.equal(ps[0], before)
    with pytest.raises(ValueError, match="2 m tensors and 1 v"):
        _native._InPlaceMoments(ms[:2], vs[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sub_group_size", [10**9, 1023, 3000])
def test_low_precision_params_written_by_the_kernel(tmp_path, dtype, sub_group_size):
    """bf16 / fp16 params get the kernel's fused rounded copy, into the
    param itself (a sub-group that is one piece of one param) or through a
    buffer of their dtype (pieces of several params): exactly the master
    cast as torch casts, and the master within 1e-6 of torch's fp32 AdamW
    (an ulp or so: the kernel's fused multiply-adds; fp16's 11 bits show
    that where bf16's 8 round it away)."""
    ps = make_params([1023, 4097, 5], dtype)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ps]
    opt = tzt.AdamW(ps, lr=1e-2, offload="cpu", sub_group_size=sub_group_size)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p, r in zip(ps, ref):
            grad = torch.randn(p.shape, generator=g).to(dtype)
            p.grad, r.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
    masters = opt.state_dict()["state"]
    for k, (p, r) in enumerate(zip(ps, ref)):
        assert p.dtype == dtype
        master = masters[k]["master"].view(p.shape)
        assert torch.equal(p.detach(), master.to(dtype))
        rel = ((master - r.detach()).abs().max() / r.detach().abs().max()).item()
        assert rel <= 1e-6, rel


def test_step_in_backward_refuses_gradient_accumulation(tmp_path):
    # A second backward before step() was skipped by step() and zeroed:
    # training saw the first micro-batch alone.
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="nvme", nvme_path=tmp_path / "n", step_in_backward=True)
    x = torch.randn(4, 8)
    m(x).sum().backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        m(x).sum().backward()


def test_a_refused_step_steps_no_sub_group(tmp_path):
    # The sparse gradient is in the second sub-group: the first was
    # stepped, then skipped by the next step; a param of no elements
    # counted the refused step.
    ours = [torch.nn.Parameter(torch.ones(n)) for n in (6, 6, 0)]
    ref = [torch.nn.Parameter(torch.ones(n)) for n in (6, 6, 0)]
    opt = tzt.AdamW(ours, lr=0.1, offload="nvme", nvme_path=tmp_path / "nvme", sub_group_size=6)
    ours[0].grad = torch.full((6,), 0.5)
    ours[1].grad = torch.sparse_coo_tensor([[0]], [1.0], (6,))
    ours[2].grad = torch.ones(0)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(ours[0].detach(), torch.ones(6)), "a sub-group stepped before the refusal"
    torch_opt = torch.optim.AdamW(ref, lr=0.1, foreach=False)
    for p in ours + ref:
        p.grad = torch.full(p.shape, 0.5)
    opt.step()
    torch_opt.step()
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a, b)
    assert float(opt.state_dict()["state"][2]["step"]) == float(torch_opt.state[ref[2]]["step"]) == 1.0


def test_an_optimizer_built_before_offload_parameters_names_the_order(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none")
    opt.param_groups[0]["lr"] = 0.5
    saved = opt.state_dict()
    opt.save_checkpoint(tmp_path / "ck")
    opt.param_groups[0]["lr"] = 1e-2
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    m(torch.randn(2, 64)).sum().backward()
    with pytest.raises(RuntimeError, match="after offload_parameters"):
        opt.step()
    # The loads and the state's reads use the params too (they failed on a
    # size mismatch); a refused load changes nothing.
    for use in (lambda: opt.load_state_dict(saved), lambda: opt.load_checkpoint(tmp_path / "ck")):
        with pytest.raises(RuntimeError, match="after offload_parameters"):
            use()
        assert opt.param_groups[0]["lr"] == 1e-2
    with pytest.raises(RuntimeError, match="after offload_parameters"):
        opt.save_checkpoint(tmp_path / "ck2")
    h.remove()
    # Step in backward steps in the hook, on the live param: the update
    # was made in place, then dropped with the live data at its release
    # (the offloaded params never changed, silently).
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none", step_in_backward=True)
    h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=100)
    with pytest.raises(RuntimeError, match="after offload_parameters"):
        m(torch.randn(2, 64)).sum().backward()
    h.remove()


def test_read_state_refuses_one_tensor_for_two_states():
    p = torch.nn.Parameter(torch.ones(8))
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        opt = tzt.AdamW([p], lr=0.1, offload="nvme", nvme_path=d)
        p.grad = torch.ones(8)
        opt.step()
        t = torch.empty(8)
        with pytest.raises(ValueError, match="distinct"):
            opt._native.read_state(0, t, t, torch.empty(8))
        opt.state_dict()


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_distributed_checkpoint_state_dicts_round_trip_without_a_step(offload, tmp_path):
    # torch.distributed.checkpoint (FSDP2, accelerate, torchtitan) ran a
    # zero-lr step on every save, finding `opt.state` empty: the moments
    # decayed and the step count grew by one per save.
    dcp = pytest.importorskip("torch.distributed.checkpoint.state_dict")

    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    def train(m, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            m(torch.randn(2, 8, generator=g)).square().sum().backward()
            opt.step()
            opt.zero_grad()

    m = model()
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload=offload, nvme_path=tmp_path / "a")
    train(m, opt, 3, 1)
    before = opt.state_dict()
    osd = dcp.get_optimizer_state_dict(m, opt)
    after = opt.state_dict()
    for k, st in before["state"].items():
        for key, t in st.items():
            assert torch.equal(t, after["state"][k][key]), (k, key)
    assert {float(st["step"]) for st in after["state"].values()} == {3.0}
    # Loaded into a fresh optimizer, training goes on with the same bits.
    m2 = model()
    m2.load_state_dict(m.state_dict())
    opt2 = tzt.AdamW(m2.parameters(), lr=1e-2, offload=offload, nvme_path=tmp_path / "b")
    dcp.set_optimizer_state_dict(m2, opt2, osd)
    train(m, opt, 2, 2)
    train(m2, opt2, 2, 2)
    assert weight_hash(m.parameters()) == weight_hash(m2.parameters())


def test_state_dict_hooks_run_as_torchs():
    p = torch.nn.Parameter(torch.ones(4))
    opt = tzt.AdamW([p], offload="none")
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load pre", sd.get("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    assert calls == ["save pre", ("load pre", 1), "load post"]
    assert float(opt.state[p]["step"]) == 1.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_params_the_fp32_master_cannot_hold_are_refused(dtype):
    # A complex param lost its imaginary part, a float64 one its precision.
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    with pytest.raises(ValueError, match=f"is {dtype}: give torch.optim.AdamW"):
        tzt.AdamW([p], offload="cpu")


def test_a_frozen_integer_param_is_taken_and_never_stepped():
    # A quantized base weight (QLoRA's uint8) among model.parameters(): it
    # has no gradient, ever, and must not be refused as the floats are.
    w = torch.nn.Parameter(torch.ones(8))
    q = torch.nn.Parameter(torch.arange(16, dtype=torch.uint8), requires_grad=False)
    opt = tzt.AdamW([w, q], lr=0.1, offload="cpu")
    w.grad = torch.ones(8)
    opt.step()
    assert torch.equal(q, torch.arange(16, dtype=torch.uint8))
    assert not torch.equal(w.detach(), torch.ones(8))


def test_pickling_or_copying_is_refused_with_the_way_to_save():
    import copy
    import pickle

    opt = tzt.AdamW([torch.nn.Parameter(torch.ones(4))], offload="none")
    for copier in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="state_dict"):
            copier(opt)


def test_state_no_memory_holds_is_refused_with_the_numbers():
    # Its allocation aborted the process ("memory allocation of 4000000000
    # bytes failed").
    p = torch.nn.Parameter(torch.empty(2**50, device="meta"))
    with pytest.raises(MemoryError, match="bytes are available"):
        tzt.AdamW([p], offload="cpu")


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_native_calls_on_a_sub_group_of_no_elements(offload, tmp_path):
    # torch exports an empty tensor with a null data pointer; a slice of it
    # was undefined behaviour (the debug build aborted Python).
    from tierzero import _native

    kw = {"nvme_path": str(tmp_path)} if offload == "nvme" else {}
    opt = _native._OffloadAdam([0, 4], offload, **kw)
    empty = torch.empty(0)
    opt.load(0, empty, torch.empty(0), torch.empty(0))
    opt.step_group(0, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, torch.empty(0), torch.empty(0))
    opt.step_group(0, 2, 1e-3, 0.9, 0.999, 1e-8, 0.0, torch.empty(0), torch.empty(0, dtype=torch.bfloat16))
    opt.read_state(0, torch.empty(0), torch.empty(0), torch.empty(0))
    master = torch.arange(4, dtype=torch.float32)
    opt.load(1, master, torch.zeros(4), torch.zeros(4))
    out = torch.empty(4)
    opt.step_group(1, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, torch.ones(4), out)
    ref = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    ref.grad = torch.ones(4)
    torch_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0, foreach=False)
    torch_opt.step()
    # torch's single-tensor AdamW rounds its step in another order: within
    # float32's last bits.
    assert torch.allclose(out, ref.detach(), rtol=1e-6, atol=0), (out, ref)


# Which params have a gradient at each step: counts drift apart (a param
# that skips steps beside others of its sub-group), two counts meet in one
# sub-group, and a param is idle beside them.
_SKIPS = [{0}, {0, 1}, {1, 2}, {0, 2}, {0, 1, 2}, {2}]


def _skipping_run(make_opt, dtype, steps, opt=None, ps=None, start=0):
    """Params of 5, 7 and 9 elements stepped by ``make_opt`` on ``_SKIPS``,
    with torch.optim.AdamW(foreach=False) over fp32 copies beside them
    (the master a 16-bit param's optimizer keeps): ``(ps, opt, ref,
    ref_opt)``."""
    torch.manual_seed(0)
    init = [torch.randn(n) for n in (5, 7, 9)]
    if ps is None:
        ps = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in init]
    ref = [torch.nn.Parameter(t.to(dtype).to(torch.float32, copy=True)) for t in init]
    opt = make_opt(ps) if opt is None else opt
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(7)
    for step in range(start + steps):
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in ps]
        for k, (p, r) in enumerate(zip(ps, ref)):
            p.grad = grads[k] if k in _SKIPS[step] else None
            r.grad = grads[k].float() if k in _SKIPS[step] else None
        if step >= start:
            opt.step()
        ref_opt.step()
    return ps, opt, ref, ref_opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_a_param_that_skips_steps_keeps_its_own_step_count(offload, dtype, tmp_path):
    # One step count per sub-group advanced for every param of it, a param
    # without a gradient included (restored, not stepped): its next step was
    # bias-corrected with the others' count (0.074 for a first step that
    # moves 0.1 at lr 0.1), and state_dict() said the others' count too.
    # Every path but the in-place fp32 one (each param its own sub-group)
    # did so. sub_group_size 8 puts params over two sub-groups and two
    # params of different counts into one.
    def make(ps, path="nvme"):
        return tzt.AdamW(ps, lr=0.1, weight_decay=0.1, offload=offload, nvme_path=tmp_path / path, sub_group_size=8)

    def check(ps, opt, ref, ref_opt):
        ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        for k, (p, r) in enumerate(zip(ps, ref)):
            assert ours[k]["step"].item() == theirs[k]["step"].item(), (k, ours[k]["step"], theirs[k]["step"])
            master = ours[k]["master"] if dtype != torch.float32 else p.detach()
            torch.testing.assert_close(master, r.detach(), rtol=0, atol=2e-6)
            torch.testing.assert_close(ours[k]["exp_avg"], theirs[k]["exp_avg"], rtol=0, atol=1e-6)
            torch.testing.assert_close(ours[k]["exp_avg_sq"], theirs[k]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
            # A 16-bit param is its master rounded (to nearest even).
            assert torch.equal(p.detach(), master.to(dtype))

    whole = _skipping_run(make, dtype, len(_SKIPS))
    check(*whole)
    assert [ours["step"].item() for ours in whole[1].state_dict()["state"].values()] == [4, 3, 4]
    # Resumed after 3 steps from state_dict() and from save_checkpoint():
    # the same bits as the run that was not stopped.
    ps, opt, _, _ = _skipping_run(make, dtype, 3)
    sd = opt.state_dict()
    opt.save_checkpoint(tmp_path / "opt.bin")
    for name, load in [("sd", lambda o: o.load_state_dict(sd)), ("ckpt", lambda o: o.load_checkpoint(tmp_path / "opt.bin"))]:
        # The model's weights come with it (a state dict holds no fp32
        # param's values, as torch's); a checkpoint sets them.
        fresh = [torch.nn.Parameter(p.detach().clone() if name == "sd" else torch.zeros_like(p)) for p in ps]
        resumed = make(fresh, name)
        load(resumed)
        run = _skipping_run(None, dtype, len(_SKIPS) - 3, opt=resumed, ps=fresh, start=3)
        check(*run)
        for p, q in zip(whole[0], fresh):
            assert torch.equal(p.detach(), q.detach()), name


def test_a_checkpoint_of_one_count_per_sub_group_still_loads(tmp_path):
    # Checkpoints written while a sub-group kept one count hold it at each
    # of its pieces' starts, the format the per-param counts keep: each
    # param loads with its sub-group's count, as it was stepped.
    import json

    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7))
    opt = tzt.AdamW([a, b], lr=0.1, offload="nvme", nvme_path=tmp_path / "a", sub_group_size=8)
    for k in range(3):
        a.grad, b.grad = torch.ones(5), (torch.ones(7) if k == 2 else None)
        opt.step()
    opt.save_checkpoint(tmp_path / "opt.bin")
    data = (tmp_path / "opt.bin").read_bytes()
    n = int.from_bytes(data[8:16], "little")
    head = json.loads(data[16 : 16 + n])
    assert head["steps"] == [[0, 3], [5, 1], [8, 1]]  # a's piece, b's two
    # As the writer of one count per sub-group saved it: b's first piece
    # was in a's sub-group, counted 3.
    head["steps"] = [[0, 3], [5, 3], [8, 1]]
    old = json.dumps(head).encode()
    (tmp_path / "old.bin").write_bytes(data[:8] + len(old).to_bytes(8, "little") + old + data[16 + n :])
    again = tzt.AdamW([a, b], lr=0.1, offload="nvme", nvme_path=tmp_path / "b", sub_group_size=8)
    again.load_checkpoint(tmp_path / "old.bin")
    assert [s.steps for s in again._subgroups] == [[3, 3], [1]]
    assert {k: st["step"].item() for k, st in again.state_dict()["state"].items()} == {0: 3.0, 1: 3.0}
    # And under another sub_group_size, each param the latest count its
    # saved pieces had.
    other = tzt.AdamW([a, b], lr=0.1, offload="nvme", nvme_path=tmp_path / "c", sub_group_size=100)
    other.load_checkpoint(tmp_path / "opt.bin")
    assert [s.steps for s in other._subgroups] == [[3, 1]]


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_step_in_backward_refuses_a_gradient_that_is_not_finite(offload, tmp_path):
    # torch.amp.GradScaler (fp16) with step_in_backward: the scaled loss
    # overflowed, backward stepped the inf gradients (the params NaN), and
    # scaler.step(opt) then raised torch's bare "No inf checks were
    # recorded". Refused in backward, naming the cause, before the
    # sub-group steps: the params are as they were.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload=offload, nvme_path=tmp_path / "n", step_in_backward=True)
    before = [p.detach().clone() for p in m.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x = torch.randn(8, 16) * 100
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(x).float().pow(2).mean()
    with pytest.raises(RuntimeError, match=r"not finite.*GradScaler.*step_in_backward=False"):
        scaler.scale(loss).backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    # A finite backward after it (no scaler) steps as before.
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))


def test_a_save_killed_mid_write_leaves_no_temp_file_for_good(tmp_path):
    # A save_checkpoint killed while writing left <path>.tmp.<pid>, the
    # state's size, beside the checkpoint for good: no later save or load
    # removed it. The next save or load of the path removes the temps whose
    # writer is gone (its lock, held while it writes, is free); a save in
    # progress in another process keeps its own.
    import os
    import signal
    import subprocess
    import sys
    import warnings

    path = tmp_path / "opt.bin"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch, tierzero.torch as tzt\n"
            "ps = [torch.nn.Parameter(torch.randn(1000)) for _ in range(2)]\n"
            "opt = tzt.AdamW(ps, offload='cpu')\n"
            "read, calls = opt._native.read_state, []\n"
            "def reading(*args):\n"
            "    calls.append(1)\n"
            "    if len(calls) == 2:\n"
            "        print('writing', flush=True)\n"
            "        sys.stdin.read()\n"
            "    return read(*args)\n"
            "opt._native.read_state = reading\n"
            "opt.save_checkpoint(sys.argv[1])\n",
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "writing"
        temp = tmp_path / f"opt.bin.tmp.{child.pid}"
        assert temp.exists()
        ps = [torch.nn.Parameter(torch.randn(1000)) for _ in range(2)]
        opt = tzt.AdamW(ps, offload="cpu")
        for p in ps:
            p.grad = torch.ones(1000)
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing removed, nothing said
            opt.save_checkpoint(path)
        assert temp.exists(), "a save in progress lost its temp file"
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        child.stdin.close()
        child.kill()
        child.wait()
    # Its writer is gone: the next save removes it, and says so.
    other = tmp_path / "other.bin.tmp.1"  # another checkpoint's, left alone
    other.write_bytes(b"x")
    with pytest.warns(UserWarning, match=r"removed 1 temporary file.*opt\.bin\.tmp\.[0-9]+ \(24[0-9]{3} bytes\)"):
        opt.save_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt.bin", "other.bin.tmp.1"]
    # A load too, of this process's pid's temp as well (a restarted
    # container's trainer has its predecessor's pid).
    (tmp_path / f"opt.bin.tmp.{os.getpid()}").write_bytes(b"x" * 10)
    (tmp_path / f"opt.bin.tmp.{_dead_pid()}").write_bytes(b"x" * 10)
    with pytest.warns(UserWarning, match="removed 2 temporary file"):
        opt.load_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt.bin", "other.bin.tmp.1"]

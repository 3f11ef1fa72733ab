"""offload_parameters under what ordinary PyTorch training code does to a
model: gradient checkpointing, deep copies (EMA), pickling, inference-mode
evaluation, torch.compile, casts, dropping the model, assign-loads."""

import copy
import gc
import io
import os
import pickle
import weakref

import pytest

torch = pytest.importorskip("torch")
import tierzero.torch as tzt  # noqa: E402
from tierzero.offload import home_of  # noqa: E402

DIM = 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)  # saves its weight itself
        self.norm.requires_grad_(False)
        self.a = torch.nn.Linear(DIM, DIM)
        self.b = torch.nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + self.b(torch.relu(self.a(self.norm(h))))


class Net(torch.nn.Module):
    """Three blocks (each checkpointed or not), a head tied to the input
    embedding, frozen params inside and outside the blocks."""

    def __init__(self, ckpt=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.blocks[1].a.requires_grad_(False)
        with torch.no_grad():
            for b in self.blocks:
                b.norm.weight.uniform_(0.5, 1.5)
        self.head = torch.nn.Linear(DIM, 40, bias=False)
        self.head.weight = self.emb.weight
        self.ckpt = ckpt  # None, or use_reentrant for torch.utils.checkpoint

    def forward(self, ids):
        h = self.frozen(self.emb(ids))
        for b in self.blocks:
            if self.ckpt is None:
                h = b(h)
            else:
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.ckpt)
        return self.head(h)


def offload(m, device, tmp_path, **kw):
    kw.setdefault("param_persistence_threshold", 100)
    return tzt.offload_parameters(m, device, nvme_path=tmp_path / "p", **kw)


def batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 40, (4, 8), generator=g) for _ in range(n)]


def loss_of(m, ids):
    return torch.nn.functional.cross_entropy(m(ids).reshape(-1, 40), ids.reshape(-1))


def train(m, handle=None, steps=3):
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none")
    losses = []
    for ids in batches(steps):
        loss = loss_of(m, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if handle is not None:
            assert handle.live_numel() == 0
    return losses


def values(m, handle=None):
    if handle is not None:
        handle.remove()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_is_bit_identical(device, reentrant, tmp_path):
    # use_reentrant=False (transformers 5's default): the recompute's
    # release emptied params the recomputed graph had saved, and their
    # AccumulateGrad failed on a size-0 tensor; a frozen param that the
    # recompute saved itself (the LayerNorm's weight) was empty there.
    ref = Net()
    ref_losses = train(ref)
    m = Net(ckpt=reentrant)
    h = offload(m, device, tmp_path, param_persistence_threshold=50)
    assert home_of(m.blocks[0].norm.weight) is not None
    assert train(m, h) == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(values(m, h), values(ref)))


def test_hf_gradient_checkpointing_is_bit_identical(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def run(offloaded):
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg)
        m.train()
        if offloaded:
            m.gradient_checkpointing_enable()  # use_reentrant=False
            h = tzt.offload_parameters(m, "cpu", param_persistence_threshold=500)
        opt = tzt.AdamW(m.parameters(), lr=1e-3, offload="none")
        losses = []
        for _ in range(2):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if offloaded:
            assert h.live_numel() == 0
        return losses

    assert run(True) == run(False)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_deepcopy_gives_a_plain_copy(device, tmp_path):
    m = Net()
    h = offload(m, device, tmp_path)
    train(m, h, steps=2)
    with h.gathered():
        want = {k: v.clone() for k, v in m.state_dict().items()}
        want_out = m(batches(1)[0])
    c = copy.deepcopy(m)
    assert c.head.weight is c.emb.weight  # tied params stay tied
    got = c.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(home_of(p) is None for p in c.parameters())
    assert [p.requires_grad for p in c.parameters()] == [p.requires_grad for p in m.parameters()]
    # None of the offload's hooks, no instance __deepcopy__.
    for sub in c.modules():
        assert "__deepcopy__" not in vars(sub)
        assert not sub._forward_pre_hooks and not sub._forward_hooks
        assert not sub._load_state_dict_pre_hooks and not sub._load_state_dict_post_hooks
        assert not sub._state_dict_hooks
    assert torch.equal(c(batches(1)[0]), want_out)
    # The original is still offloaded and trains on.
    assert all(p.numel() == 0 for p in (m.emb.weight, m.blocks[0].a.weight))
    assert h.live_numel() == 0
    # A submodule's copy, and a copy through a container holding the model.
    blk = copy.deepcopy(m.blocks[1])
    assert torch.equal(blk.a.weight, want["blocks.1.a.weight"]) and not blk.a._forward_pre_hooks
    box = copy.deepcopy({"model": m})
    assert torch.equal(box["model"].blocks[2].b.weight, want["blocks.2.b.weight"])
    # The copy trains as a plain model: its own optimizer moves its weights.
    before = c.blocks[0].a.weight.detach().clone()
    train(c, steps=1)
    assert not torch.equal(before, c.blocks[0].a.weight)
    h.remove()
    assert all("__deepcopy__" not in vars(sub) for sub in m.modules())


def test_ema_averaged_model_matches_one_without_offload(tmp_path):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def run(device):
        m = Net()
        h = offload(m, device, tmp_path) if device else None
        opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none")
        ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for ids in batches(4):
            loss_of(m, ids).backward()
            opt.step()
            opt.zero_grad()
            if h is None:
                ema.update_parameters(m)
            else:
                # update_parameters reads the model's params: gathered.
                with h.gathered():
                    ema.update_parameters(m)
        with torch.no_grad():
            out = ema(batches(1)[0])
        return out, ema.state_dict()

    ref_out, ref_sd = run(None)
    for device in ("cpu", "nvme"):
        out, sd = run(device)
        assert torch.equal(out, ref_out)
        assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_pickling_an_offloaded_model_is_refused_with_the_fix(device, tmp_path):
    m = Net()
    h = offload(m, device, tmp_path)
    for dump in (lambda: torch.save(m, io.BytesIO()), lambda: pickle.dumps(m), lambda: pickle.dumps(m.blocks[0])):
        with pytest.raises(TypeError, match=r"save model\.state_dict\(\).*remove\(\)"):
            dump()
    with pytest.raises(TypeError, match="deepcopy"):
        copy.deepcopy(h)
    h.remove()
    assert pickle.loads(pickle.dumps(m)).state_dict().keys() == m.state_dict().keys()


def test_an_inference_mode_forward_that_skips_a_module_leaves_no_inference_buffer(tmp_path):
    class EarlyExit(Net):
        def forward(self, ids, early=False):
            h = self.frozen(self.emb(ids))
            for b in self.blocks[: 1 if early else 3]:
                h = b(h)
            return self.head(h)

    def run(device):
        m = EarlyExit()
        h = offload(m, device, tmp_path) if device else None
        opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="none")
        losses = []
        for ids in batches(3):
            loss = loss_of(m, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            with torch.inference_mode():
                m(ids, early=True)  # prefetches blocks 1 and 2, never fetched
        if h is not None:
            assert h.prefetched > 0
        return losses

    assert run("nvme") == run(None)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_torch_compile_over_an_offloaded_model(device, tmp_path):
    # Dynamo traced into the NVMe fetch's aio calls and failed.
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    ref = Net()
    ref_losses = train(ref)
    m = Net()
    h = offload(m, device, tmp_path)
    compiled = torch.compile(m, backend="eager")
    assert train(compiled, h) == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(values(m, h), values(ref)))
    torch._dynamo.reset()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_cast_after_the_offload_is_refused_by_state_dict_and_gathered(device, tmp_path):
    m = Net()
    h = offload(m, device, tmp_path)
    m.half()
    for use in (m.state_dict, lambda: h.gathered().__enter__(), lambda: copy.deepcopy(m)):
        with pytest.raises(RuntimeError, match="cast the model before offload_parameters"):
            use()
    # Still refused after all of them (gathered() turned the params back).
    with pytest.raises(RuntimeError, match="cast the model before offload_parameters"):
        m(batches(1)[0])
    # remove() gives the plain model the cast made.
    h.remove()
    ref = Net().half()
    assert all(p.dtype == torch.float16 for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_the_optimizer_keeps_the_offload_of_its_params(step_in_backward, tmp_path):
    m = Net()
    h = offload(m, "nvme", tmp_path)
    opt = tzt.AdamW(m.parameters(), lr=1e-2, offload="cpu", step_in_backward=step_in_backward)
    loss_of(m, batches(1)[0]).backward()
    opt.step()
    with h.gathered():
        want = [p.detach().clone() for p in m.parameters()]
    params = list(m.parameters())
    r = weakref.ref(h)
    del m, h
    gc.collect()
    # The model dropped, the optimizer's params keep their values.
    assert r() is not None
    sd = opt.state_dict()
    assert [tuple(s["exp_avg"].shape) for s in sd["state"].values()] == [tuple(w.shape) for w in want]
    with r().gathered():
        assert all(torch.equal(p, w) for p, w in zip(params, want))
    # Dropped too, the optimizer takes the offload and its file with it.
    del opt, params
    gc.collect()
    assert r() is None
    assert os.listdir(tmp_path / "p") == []


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_an_assign_load_is_refused_with_the_fix(device, tmp_path):
    sd = Net().state_dict()
    m = Net()
    h = offload(m, device, tmp_path)
    for target in (m, m.blocks[0]):
        part = sd if target is m else {k[len("blocks.0."):]: v for k, v in sd.items() if k.startswith("blocks.0.")}
        with pytest.raises(RuntimeError, match="load without assign=True"):
            target.load_state_dict(part, assign=True)
    assert all(home_of(p) is not None for p in m.blocks[0].parameters() if p.numel() == 0)
    # A fresh one: torch leaves assign=True in a state dict's _metadata.
    sd = Net().state_dict()
    m.load_state_dict(sd)
    with h.gathered():
        assert all(torch.equal(v, m.state_dict()[k]) for k, v in sd.items())
    h.remove()

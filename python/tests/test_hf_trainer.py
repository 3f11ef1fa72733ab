"""The HF Trainer recipe: tierzero.torch.AdamW through `optimizers=` and
through `optimizer_cls_and_kwargs=`, against `optim="adamw_torch"`.

A GPT-2 of 2 layers from a small GPT2Config, byte-level windows of
data/corpus.txt, use_cpu=True, 100 steps with warmup, max_grad_norm=1.0
and weight decay; every logged loss must match torch's AdamW within 1e-4.
"""

import inspect
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tierzero.torch as tzt  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"
SEQ = 32
STEPS = 100


class Windows(torch.utils.data.Dataset):
    def __init__(self, n):
        data = CORPUS.read_bytes()
        self.ids = torch.tensor(list(data[: n * SEQ]), dtype=torch.long).view(n, SEQ)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def args(tmp_path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=10,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kw,
    )


def losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def decay_groups(m, wd):
    # HF's split: no decay for biases and LayerNorm weights.
    decay = set(transformers.trainer_pt_utils.get_parameter_names(m, [torch.nn.LayerNorm]))
    decay = {n for n in decay if "bias" not in n}
    return [
        {"params": [p for n, p in m.named_parameters() if n in decay], "weight_decay": wd},
        {"params": [p for n, p in m.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    t = transformers.Trainer(model=model(), args=args(tmp, optim="adamw_torch"), train_dataset=Windows(512))
    return losses(t)


def check(got, ref):
    assert len(got) == len(ref) == STEPS
    worst = max(abs(a - b) for a, b in zip(got, ref))
    assert worst <= 1e-4, f"largest loss difference {worst}: {got[:3]}..{got[-3:]} vs {ref[:3]}..{ref[-3:]}"
    assert ref[-1] < ref[0] - 1.0  # it trained


def test_optimizers_tuple_nvme(reference, tmp_path):
    m = model()
    opt = tzt.AdamW(decay_groups(m, 0.1), lr=1e-3, offload="nvme", nvme_path=tmp_path / "nvme", sub_group_size=20_000)
    t = transformers.Trainer(model=m, args=args(tmp_path), train_dataset=Windows(512), optimizers=(opt, None))
    check(losses(t), reference)
    read, written = opt.nvme_bytes()
    assert read > 0 and written > 0


def test_optimizer_cls_and_kwargs_cpu(reference, tmp_path):
    if "optimizer_cls_and_kwargs" not in inspect.signature(transformers.Trainer.__init__).parameters:
        pytest.skip("this transformers has no optimizer_cls_and_kwargs")
    m = model()
    t = transformers.Trainer(
        model=m,
        args=args(tmp_path),
        train_dataset=Windows(512),
        optimizer_cls_and_kwargs=(tzt.AdamW, {"lr": 1e-3, "offload": "cpu"}),
    )
    got = losses(t)
    assert isinstance(t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer, tzt.AdamW)
    check(got, reference)


def test_bare_accelerate_loop(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    results = []
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
        lambda ps: tzt.AdamW(ps, lr=1e-3, weight_decay=0.1, offload="nvme", nvme_path=tmp_path / "acc"),
    ):
        m = model()
        opt = make(m.parameters())
        loader = torch.utils.data.DataLoader(Windows(64), batch_size=4, shuffle=False)
        m, opt, loader = acc.prepare(m, opt, loader)
        out = []
        for batch in loader:
            loss = m(**batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        results.append(out)
    assert max(abs(a - b) for a, b in zip(*results)) <= 1e-4
    os.environ.pop("ACCELERATE_USE_CPU", None)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_parameters_is_bit_identical(device, tmp_path):
    runs = []
    for offload in (False, True):
        m = model()
        handle = None
        if offload:
            handle = tzt.offload_parameters(m, device, nvme_path=tmp_path / "params", param_persistence_threshold=1000)
        opt = tzt.AdamW(decay_groups(m, 0.1), lr=1e-3, offload="nvme", nvme_path=tmp_path / f"opt{offload}")
        t = transformers.Trainer(model=m, args=args(tmp_path), train_dataset=Windows(512), optimizers=(opt, None))
        runs.append(losses(t))
        if handle is not None:
            assert handle.live_numel() == 0
            handle.remove()
    assert runs[0] == runs[1]

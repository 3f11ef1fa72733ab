"""``AdamW``: a ``torch.optim.Optimizer`` whose state lives in tierzero.

The fp32 master weights and the Adam moments ``m`` and ``v`` live in
tierzero's optimizer state (the Rust engine's own), on ``offload="none"`` /
``"cpu"`` (host memory) or ``"nvme"`` (files under ``nvme_path``, streamed
through pinned buffers). ``moments_dtype=torch.bfloat16`` stores ``m`` and
``v`` in bf16 on every tier (computed in fp32, rounded to nearest even as
they are stored): 8 bytes of state per element instead of 12, and on NVMe
a third less I/O per step. PyTorch does the forward, backward and autograd;
``step()`` runs tierzero's SIMD AdamW kernel over one sub-group at a time:

- the params of each param group are cut, in order, into sub-groups of at
  most ``sub_group_size`` elements (DeepSpeed's name and default, 1e9);
- for sub-group ``i``: its state read was issued while ``i - 1`` was
  stepped (NVMe), its gradients are gathered into one fp32 buffer, AdamW
  runs with the GIL released, and the new params are written in the same
  pass: straight into a live CPU param's memory where the sub-group is one
  piece of it, else into a buffer of the params' dtype (bf16 and fp16: the
  kernel's fused rounded copy) that is copied into the params (CPU or
  CUDA) after; its state write goes on while ``i + 1``
  is stepped. Host memory is two sub-groups of buffers, not the model.

Semantics are ``torch.optim.AdamW``'s (decoupled weight decay, bias
correction, ``eps`` after the square root), and the hyper-parameters are
re-read from ``param_groups`` at every step, so LR schedulers work. Params
changed after the optimizer is built (weights loaded, a custom init, a
``clamp_``, a DDP broadcast: an in-place op on the param or its
``detach()``, or new ``.data``) are stepped as they are: where the master is
a copy (``"nvme"``, 16-bit params), the changed pieces are read into it
before their step. A change through ``p.data.<op>_()`` bumps no version
and is not seen there. A param
whose ``.grad`` is None is not stepped, as torch skips it: when its whole
sub-group has none the sub-group is not stepped; inside a sub-group that
has gradients its state (master, moments) and values are put back after
the step (DeepSpeed steps it with a zero gradient: momentum moves a param
frozen after construction), at the cost of reading that sub-group's state
twice. Each param keeps its own step count, as torch's ``state[p]["step"]``,
advanced only when it has a gradient, and is bias-corrected with it: where
the params of a sub-group have different counts (one skipped a step the
others took) the sub-group is stepped once per count, each time putting
back the pieces of the other counts, so it costs that reading again per
count. A param given with ``requires_grad=False``
(frozen, to be unfrozen later) has sub-groups of its own, so it is not
stepped until it has a gradient.

With ``step_in_backward=True`` each sub-group is stepped as soon as the
gradients of all its params are final in backward
(``register_post_accumulate_grad_hook``), overlapping Adam and its state I/O
with the rest of backward, and those gradients are freed; ``step()`` then
steps what backward did not reach and waits for the writes. As with torch's
own optimizer-in-backward recipe, this is for one backward per step with no
gradient clipping or accumulation (the step happens before either could; a
second backward before ``step()`` is refused, where its gradients were
dropped), and with no loss scaling: ``torch.amp.GradScaler`` (fp16) unscales
the gradients, checks them for inf and skips the step in ``scaler.step(opt)``,
after backward has stepped them, scaled. A gradient that is not finite (inf
or NaN: an overflow of the scaled loss, or a model that diverged) is refused
in backward with a ``RuntimeError`` saying so, before its sub-group is
stepped (the params were made NaN, and ``scaler.step`` then raised torch's
bare "No inf checks were recorded"; sub-groups that backward finished
before it, their gradients finite, are stepped). Use
``step_in_backward=False`` with ``GradScaler``, or bf16 autocast, which
needs no scaler.

Under several processes (``torch.distributed`` initialised with a world
size above 1, or the launcher's ``RANK`` and ``WORLD_SIZE``: torchrun, HF
Trainer's and accelerate's multi-process runs) rank ``R``'s NVMe state
lives under ``<nvme_path>/rank<R>``, as DeepSpeed puts each rank under its
one ``nvme_path`` per node, so every rank can be given the same
``nvme_path`` (one directory holds one process's state: a second process
there is refused). Each rank's directory is its own for the stale files a
killed run left: the next run's rank ``R`` reclaims ``rank<R>``'s (a run
with fewer ranks leaves the higher ranks' directories alone).

``state_dict()`` is torch's format (``step``, ``exp_avg``, ``exp_avg_sq`` per
param, ``step`` the param's own count, plus ``master`` for params that are
not fp32) and materialises it in
host memory (``opt.state`` holds each stepped param's ``step`` alone: the
moments stay in tierzero's tiers); ``save_checkpoint`` / ``load_checkpoint`` stream the state one
sub-group at a time instead.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import re
import threading
import warnings

import torch

from . import _native
from ._native import _OffloadAdam
from ._adamw_parts import (
    _bump_version,
    _CudaCopies,
    _ds_settings,
    _hyper,
    _InPlaceState,
    _not_offloaded,
    _plain,
    _shape,
    _SubGroup,
    _values,
    _write_mark,
)
from .offload import (
    ParamOffload,
    _distributed,
    _remove_unlocked,
    _weakly,
    home_of,
    offload_parameters,
)

__all__ = ["AdamW", "offload_parameters", "ParamOffload"]

_MAGIC = b"TZADAMW1"


def _rank_path(nvme_path):
    """``nvme_path``, or ``<nvme_path>/rank<R>`` in rank ``R`` of several
    (see the module docs)."""
    d = _distributed()
    if d is None:
        return nvme_path
    rank, world = d
    if rank is None:
        raise ValueError(
            f"WORLD_SIZE is {world} and RANK is not set: tierzero.torch.AdamW keeps each rank's "
            f"state under <nvme_path>/rank<RANK>; set RANK (torchrun does), or "
            f"initialise torch.distributed first"
        )
    return os.path.join(os.fspath(nvme_path), f"rank{rank}")


# The temp files this process's saves are writing (``save_checkpoint``), by
# device and inode, and the lock that makes creating one and counting it
# one step for the stale-temp sweep (``_remove_stale_temps``).
_SAVING: set = set()
_SAVING_LOCK = threading.Lock()


def _remove_stale_temps(path):
    """Removes the ``<path>.tmp.<pid>`` files of saves of ``path`` that were
    killed mid-write (no ``except`` ran to remove them: each held the whole
    state's size beside ``path`` for good), with a warning naming them. A
    save holds its temp file's lock (flock) while it writes, so a temp
    whose lock is free has no writer: stale, unless this process is writing
    it (``_SAVING``: where flock is a POSIX lock, as on NFS, its own lock
    does not stop it) or its pid's process has it open on this host (that
    lock went with another fd of it, or was not taken yet). Pids are
    reused: one that names a live process, this one's included, does not
    make a temp its. A file system without locks keeps its temps."""
    path = os.path.abspath(path)
    folder, base = os.path.split(path)
    pattern = re.compile(re.escape(base) + r"\.tmp\.([0-9]+)")
    with _SAVING_LOCK:
        removed = [f"{p} ({n} bytes)" for p, n in _remove_unlocked(folder, pattern, _SAVING, "save_checkpoint")]
    if removed:
        warnings.warn(
            f"save_checkpoint: removed {len(removed)} temporary file(s) of saves of {path} that were "
            f"killed while writing: {', '.join(removed)}",
            stacklevel=3,
        )


def _refuse_not_finite(s, grad):
    """A ``RuntimeError`` if sub-group ``s``'s gathered gradient ``grad``
    holds an inf or a NaN, raised in backward (``step_in_backward``) before
    the sub-group steps: with ``torch.amp.GradScaler`` the scaled gradients
    overflow, and stepping them made the params NaN before the scaler could
    skip the step (see the module docs). The sum is one fast pass (inf or
    NaN in, not finite out); a sum that overflowed from finite values is
    told apart by the max-norm, which does not."""
    if not grad.numel() or torch.isfinite(grad.sum()):
        return
    if torch.isfinite(torch.linalg.vector_norm(grad, float("inf"))):
        return
    flat = grad.reshape(-1)
    shape = next(
        (
            tuple(_shape(p))
            for p, a, b, off in s.pieces
            if not torch.isfinite(torch.linalg.vector_norm(flat[off : off + b - a], float("inf")))
        ),
        None,
    )
    raise RuntimeError(
        f"tierzero.torch.AdamW(step_in_backward=True): the gradient of a param of shape {shape} "
        f"is not finite (inf or NaN), so its sub-group was not stepped. Loss scaling "
        f"(torch.amp.GradScaler, fp16) cannot work with step_in_backward, which steps the "
        f"scaled gradients inside backward, before the scaler unscales them, checks them for "
        f"inf and skips the step: use step_in_backward=False with GradScaler (or bf16 "
        f"autocast, which needs no scaler). Without a scaler, the model diverged."
    )


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its state in tierzero (see the module docs).

    ``offload``: ``"none"``, ``"cpu"`` or ``"nvme"`` (with ``nvme_path``);
    without it and without a ``ds_config`` that says, ``"nvme"`` (then
    ``nvme_path`` is needed).
    ``ds_config``: a ``ds_config.json`` path or dict; its
    ``zero_optimization.offload_optimizer``, ``sub_group_size``,
    ``tierzero.pinned_budget_bytes`` and ``optimizer`` block are used where
    the keyword is not given. An ``Adam`` or ``AdamW`` block is read as
    ``tierzero train`` and HF Trainer read it, the keywords in the place of
    ``TrainingArguments``' values: ``"auto"`` takes the keyword (else HF's
    default), a value that differs from a keyword given is an error naming
    both, and a key the block leaves out is DeepSpeed's default (a
    ``weight_decay`` of 0; 0.01 with ``torch_adam``). Its
    ``gradient_clipping`` is warned about (clip before ``step()``: HF
    Trainer's ``max_grad_norm``, ``torch.nn.utils.clip_grad_norm_``).
    Without a block: each keyword, else torch's defaults (1e-3,
    (0.9, 0.999), 1e-8, 1e-2).
    """

    def __init__(
        self,
        params,
        lr=None,
        betas=None,
        eps=None,
        weight_decay=None,
        amsgrad=False,
        *,
        offload=None,
        nvme_path=None,
        sub_group_size=None,
        pinned_budget_bytes=None,
        moments_dtype=torch.float32,
        ds_config=None,
        threads=None,
        step_in_backward=False,
        maximize=False,
        foreach=None,
        fused=None,
        capturable=False,
        differentiable=False,
    ):
        if amsgrad:
            raise ValueError("tierzero.torch.AdamW does not implement amsgrad=True")
        for name, flag in (("maximize", maximize), ("capturable", capturable), ("differentiable", differentiable)):
            if flag:
                raise ValueError(f"tierzero.torch.AdamW does not implement {name}=True")
        if moments_dtype in ("float32", "bfloat16"):
            moments_dtype = getattr(torch, moments_dtype)
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"moments_dtype={moments_dtype}: torch.float32 or torch.bfloat16")
        given = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        ds = _ds_settings(ds_config, given)
        hyper = _hyper(given, ds)
        lr, betas, eps, weight_decay = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False)
        super().__init__(params, defaults)
        offload = offload if offload is not None else ds.get("offload", "nvme")
        nvme_path = nvme_path if nvme_path is not None else ds.get("nvme_path")
        if offload == "nvme" and nvme_path is not None:
            nvme_path = _rank_path(nvme_path)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads={threads!r}: give a whole number of at least 1, or None (the default)")
        if isinstance(pinned_budget_bytes, int) and pinned_budget_bytes < 0:
            raise ValueError(f"pinned_budget_bytes={pinned_budget_bytes!r}: give a byte count of at least 0")
        if sub_group_size is None:
            sub_group_size = ds.get("sub_group_size", 1_000_000_000)
        if pinned_budget_bytes is None:
            pinned_budget_bytes = ds.get("pinned_budget_bytes")
        sub_group_size = int(sub_group_size)
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
        self.offload = offload
        params = [p for g in self.param_groups for p in g["params"]]
        # The offloads of its offloaded params, held for as long as it holds
        # them: a model dropped first took its offload (the homes, the
        # file) with it, and left this optimizer 0-element params.
        self._offloads = list({id(h.owner): h.owner for h in map(home_of, params) if h is not None}.values())
        # Host-memory state over fp32 CPU params: the params are the master
        # weights, stepped in place (as DeepSpeed's CPU Adam does): one
        # sub-group per param, no copies in or out.
        self._inplace = offload in ("none", "cpu") and all(
            p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() and home_of(p) is None
            for p in params
        )
        self.moments_dtype = moments_dtype
        if self._inplace:
            sub_group_size = max([p.numel() for p in params] + [1])
        self._subgroups: list[_SubGroup] = []
        for gi, group in enumerate(self.param_groups):
            sg = _SubGroup(gi)
            for p in group["params"]:
                if not p.is_contiguous():
                    raise ValueError(
                        f"tierzero.torch.AdamW needs contiguous params; a param of shape "
                        f"{tuple(p.shape)} (group {gi}) has strides {p.stride()} (channels_last?): "
                        f"build the optimizer over contiguous params (model.to(memory_format="
                        f"torch.contiguous_format))"
                    )
                home = home_of(p)
                dtype = home.dtype if home is not None else p.dtype
                # Floating and complex params other than these; an integer
                # one (a quantized base weight, frozen) never has a gradient
                # and is never stepped.
                if (dtype.is_floating_point or dtype.is_complex) and dtype not in (
                    torch.float32,
                    torch.bfloat16,
                    torch.float16,
                ):
                    # Through the fp32 master a complex param lost its
                    # imaginary part and a float64 one its precision.
                    raise ValueError(
                        f"tierzero.torch.AdamW steps float32, bfloat16 and float16 params (an fp32 "
                        f"master); a param of shape {tuple(_shape(p))} is {dtype}: give "
                        f"torch.optim.AdamW the {dtype} params"
                    )
                n, start = (home.numel if home is not None else p.numel()), 0
                # A param frozen now (``requires_grad=False``) gets
                # sub-groups of its own: while it has no gradient they are
                # not stepped, as torch skips it, where in a sub-group with
                # gradients it would be stepped with a zero one (decayed by
                # the weight decay, its moments moved), frozen or not.
                frozen = not p.requires_grad
                if frozen and sg.numel:
                    self._subgroups.append(sg)
                    sg = _SubGroup(gi)
                while start < n:
                    take = min(n - start, sub_group_size - sg.numel)
                    sg.add(p, start, start + take)
                    start += take
                    if sg.numel == sub_group_size or ((self._inplace or frozen) and start == n):
                        self._subgroups.append(sg)
                        sg = _SubGroup(gi)
            if sg.numel:
                self._subgroups.append(sg)
        if self._inplace:
            self._native = _InPlaceState(self._subgroups, threads, moments_dtype)
        else:
            self._native = _OffloadAdam(
                [s.numel for s in self._subgroups],
                offload,
                os.fspath(nvme_path) if nvme_path is not None else None,
                pinned_budget_bytes,
                threads,
                "bfloat16" if moments_dtype == torch.bfloat16 else "float32",
            )
        # Params of no elements belong to no sub-group; torch still counts
        # their steps (and lists them in its state_dict).
        self._empty_steps = {
            p: 0 for g in self.param_groups for p in g["params"] if p.numel() == 0 and home_of(p) is None
        }
        largest = max((s.numel for s in self._subgroups), default=0) if not self._inplace else 0
        on_cuda = any((home_of(p) is None and p.device.type == "cuda") for p in params)
        self._copies = _CudaCopies(largest) if on_cuda and not self._inplace else None
        self._grad_buf = self._copies.grad if self._copies else torch.empty(largest, dtype=torch.float32)
        self._largest = largest
        self._out_bufs = {}  # dtype -> the kernel's output for scattered sub-groups
        # Per param not offloaded: its version and storage when this
        # optimizer last wrote it (or read it, here); a param changed since
        # has all its pieces, in every sub-group, read into the master
        # before their steps (_adopt_changed).
        self._written: dict = {}
        self._stale: set = set()  # (param, start) of pieces to read
        self._pieces_of: dict = {}  # param -> the starts of its pieces
        for s in self._subgroups:
            for p, a, *_ in s.pieces:
                self._pieces_of.setdefault(p, []).append(a)
        if not self._inplace:
            with torch.no_grad():
                for i, s in enumerate(self._subgroups):
                    self._native.load(i, self._gather_params(s))
                    self._note_written(s)
        # Step in backward: per sub-group, its params whose gradients are
        # not final yet in this backward; per param, its sub-groups.
        self.step_in_backward = bool(step_in_backward)
        self._hooks = []
        self._stepped: set[int] = set()
        self._last_stepped = None
        if self.step_in_backward:
            self._param_sgs: dict = {}
            for i, s in enumerate(self._subgroups):
                for p, *_ in s.pieces:
                    self._param_sgs.setdefault(p, []).append(i)
            self._waiting = [None] * len(self._subgroups)
            self._reset_waiting()
            for p in self._param_sgs:
                if p.requires_grad:
                    # Weakly: a tensor's hooks are held from C++, where the
                    # garbage collector misses the cycle param -> hook ->
                    # optimizer -> param, so a dropped optimizer (and the
                    # offload it holds, with its file) was never collected.
                    self._hooks.append(p.register_post_accumulate_grad_hook(_weakly(self._grad_final)))
        self._built = True

    def __reduce_ex__(self, protocol):
        # The inherited pickling kept the param groups and dropped the
        # native state: the copy's first step() raised AttributeError.
        raise TypeError(
            "tierzero.torch.AdamW cannot be pickled or copied: its state lives in tierzero's "
            "tiers (host memory, NVMe files); save it with state_dict() or save_checkpoint()"
        )

    def add_param_group(self, param_group):
        """torch's, while constructing. After that a group's params would
        belong to no sub-group: never stepped, saved as zeros. Refused
        rather than ignored (Lightning's ``BaseFinetuning`` unfreezes this
        way: give every group at construction, ``requires_grad=False`` for
        the frozen ones, and they are stepped once they have gradients)."""
        if getattr(self, "_built", False):
            raise NotImplementedError(
                "tierzero.torch.AdamW cannot add a param group after it is built: its state "
                "is laid out over the params it was given; build it with every group "
                "(frozen params included) instead"
            )
        super().add_param_group(param_group)

    def plan(self) -> str:
        """Where the state lives and what the pinned buffers are."""
        return self._native.plan()

    def nvme_bytes(self):
        """``(read, written)`` bytes of state I/O so far."""
        return self._native.io_bytes()

    # Gather and scatter between params and flat fp32 buffers.
    def _gather_params(self, s: _SubGroup):
        buf = self._grad_buf[: s.numel]
        for p, a, b, off in s.pieces:
            buf[off : off + b - a].copy_(_values(p)[a:b])
        return buf

    def _gather_grads(self, s: _SubGroup):
        if self._inplace:
            (p, *_), = s.pieces
            g = p.grad
            if g is None:
                return torch.zeros(s.numel, dtype=torch.float32)
            if g.is_sparse:
                raise RuntimeError("tierzero.torch.AdamW does not support sparse gradients")
            if g.dtype == torch.float32 and not g.requires_grad and g.is_contiguous():
                return g  # as it is: the binding reads any contiguous shape
            return g.detach().reshape(-1).to(torch.float32).contiguous()
        buf = self._grad_buf[: s.numel]
        if self._copies is not None and any(p.device.type == "cuda" for p, *_ in s.pieces):
            with self._copies.gradients():
                self._copy_grads(s, buf, non_blocking=True)
        else:
            self._copy_grads(s, buf)
        return buf

    @staticmethod
    def _copy_grads(s, buf, non_blocking=False):
        for p, a, b, off in s.pieces:
            if p.grad is None:
                buf[off : off + b - a].zero_()
            else:
                if p.grad.is_sparse:
                    raise RuntimeError("tierzero.torch.AdamW does not support sparse gradients")
                buf[off : off + b - a].copy_(p.grad.detach().reshape(-1)[a:b], non_blocking=non_blocking)

    def _scatter_params(self, s: _SubGroup, src, slot=None):
        """Copies ``src`` into ``s``'s params: CUDA ones from a pinned
        ``slot`` buffer on the side stream (``_CudaCopies``), others now."""
        for p, a, b, off in s.pieces:
            home = home_of(p)
            if home is not None:
                home.write_from(src[off : off + b - a], start=a)
            elif slot is not None and p.device.type == "cuda":
                self._copies.upload(p.detach().view(-1)[a:b], src[off : off + b - a])
            else:
                p.detach().view(-1)[a:b].copy_(src[off : off + b - a])
        if slot is not None:
            self._copies.uploaded(slot)
        self._note_written(s)

    def _note_written(self, s: _SubGroup):
        for p, *_ in s.pieces:
            self._written[p] = _write_mark(p)

    def _note_steps(self):
        """``self.state[p]["step"]`` of every param stepped so far, as torch
        keeps it: code that asks whether the optimizer has state sees it
        (torch.distributed.checkpoint's ``get_optimizer_state_dict``, which
        FSDP2, accelerate and torchtitan save through, found it empty and
        ran a zero-lr step to make some: every save moved the moments and
        the step count). The moments are not here; ``state_dict()`` reads
        them."""
        steps: dict = {}
        for s in self._subgroups:
            for (p, *_), n in zip(s.pieces, s.steps):
                if n:
                    steps[p] = max(steps.get(p, 0), n)
        steps.update((p, n) for p, n in self._empty_steps.items() if n)
        for p, n in steps.items():
            st = self.state[p]
            if "step" in st:
                st["step"].fill_(float(n))
            else:
                st["step"] = torch.tensor(float(n))

    def _adopt_changed(self, i, s: _SubGroup):
        """Params of ``s`` changed since this optimizer last wrote them (a
        checkpoint loaded after it was built, a custom init, a ``clamp_``,
        a DDP broadcast: any in-place change through the param or a
        ``detach()`` of it, or new ``.data``) are read into the master
        before the step, as torch's AdamW steps the params as they are; the
        master otherwise wrote its older values over them. The moments
        stay. (A change through ``p.data.<op>_()`` bumps no version and is
        not seen; an offloaded param's home is seen changed by a
        ``model.load_state_dict`` or an in-place change while it was live,
        not by other writes to it.) Only when a change is found, it costs the
        sub-group's whole state read and written back, and 12 bytes per
        element of it in host memory meanwhile, beyond the two sub-groups of
        buffers the module docs count. An offloaded param is read again after
        a ``model.load_state_dict`` wrote its home (``_write_mark``)."""
        for p, *_ in s.pieces:
            now = _write_mark(p)
            if self._written.get(p) != now:
                # Every piece of it: another sub-group's write of its own
                # piece will change the version again before that one steps.
                self._stale.update((p, a) for a in self._pieces_of[p])
                self._written[p] = now
        changed = [piece for piece in s.pieces if (piece[0], piece[1]) in self._stale]
        if not changed:
            return
        master = torch.empty(s.numel, dtype=torch.float32)
        m, v = torch.empty_like(master), torch.empty_like(master)
        self._native.read_state(i, master, m, v)
        values = {}
        for p, a, b, off in changed:
            if p not in values:
                values[p] = _values(p)  # an offloaded one's from its home
            master[off : off + b - a] = values[p][a:b].float().cpu()
        self._native.load(i, master, m, v)
        self._stale.difference_update((p, a) for p, a, *_ in changed)

    def _finish_copies(self):
        if self._copies is not None:
            self._copies.finish()

    def _check_hyper(self, s: _SubGroup):
        """``s``'s param group's hyper-parameters are ones AdamW takes, or a
        ``ValueError`` naming the group and the value."""
        lr, beta1, beta2, eps, wd = self._hyper(s)
        bad = [
            (name, v)
            for name, v, ok in (
                ("lr", lr, lr >= 0.0),
                ("betas[0]", beta1, 0.0 <= beta1 < 1.0),
                ("betas[1]", beta2, 0.0 <= beta2 < 1.0),
                ("eps", eps, eps >= 0.0),
                ("weight_decay", wd, wd >= 0.0),
            )
            if not ok
        ]
        if bad:
            name, v = bad[0]
            raise ValueError(f"param_groups[{s.group}][{name!r}] = {v}: invalid for AdamW; nothing was stepped")

    def _hyper(self, s: _SubGroup):
        """``(lr, beta1, beta2, eps, weight_decay)`` of ``s``'s param group,
        read now (LR schedulers change them between steps)."""
        group = self.param_groups[s.group]
        beta1, beta2 = group["betas"]
        return float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])

    def _step_one(self, i, next_sg, in_backward=False):
        s = self._subgroups[i]
        if self._inplace:
            self._check_in_place(s)  # step in backward: step() checked the others
        else:
            self._adopt_changed(i, s)
        grad = self._gather_grads(s)
        if in_backward:
            _refuse_not_finite(s, grad)
        out, direct, slot = self._out_for(s)
        # The pieces that step, by their step count: each is stepped with
        # its own count (torch's per-param ``step``), and the kernel takes
        # one per call. Pieces of params without a gradient (frozen after
        # construction, an unused branch, an unrouted expert) do not step:
        # torch's AdamW leaves such a param alone, no decay and no moment
        # step (a param frozen later kept moving by its momentum).
        classes: dict = {}
        for k, (p, *_) in enumerate(s.pieces):
            if p.grad is not None or len(s.pieces) == 1:
                classes.setdefault(s.steps[k], []).append(k)
        counts = sorted(classes)
        if len(counts) == 1 and len(classes[counts[0]]) == len(s.pieces):
            # Every piece steps, with one count: the one call, the pipeline's.
            self._native.step_group(i, counts[0] + 1, *self._hyper(s), grad, out, next_sg)
            s.steps[:] = [n + 1 for n in s.steps]
        else:
            self._step_by_count(i, s, classes, grad, out, next_sg)
        if direct:
            _bump_version(s.pieces[0][0])
            self._note_written(s)
        else:
            self._scatter_params(s, out, slot)
        self._stepped.add(i)

    def _step_by_count(self, i, s: _SubGroup, classes, grad, out, next_sg):
        """Steps the pieces of ``classes`` (step count -> piece indices) of
        sub-group ``i``, one kernel call per count, and leaves the other
        pieces as they were: the kernel steps every element of a sub-group,
        so after each call the state (master, moments) of the pieces not of
        that count is put back and loaded, at the cost of reading the
        sub-group's state twice per count. ``out`` gets every piece's new
        value (the put-back pieces their master's, rounded as the kernel
        rounds: to nearest even). Each count is advanced once its state is
        loaded: a call that raised (an I/O error) leaves the counts of the
        pieces it did not step, and their next bias correction, as they
        were."""
        cur = [torch.empty(s.numel, dtype=torch.float32) for _ in range(3)]
        after = [torch.empty(s.numel, dtype=torch.float32) for _ in range(3)]
        self._native.read_state(i, *cur)
        counts = sorted(classes)
        for c, n in enumerate(counts):
            last = c + 1 == len(counts)
            # The next sub-group's read is issued by the last call alone: a
            # call for this one again would drop it.
            self._native.step_group(i, n + 1, *self._hyper(s), grad, out, next_sg if last else None)
            self._native.read_state(i, *after)
            stepped = set(classes[n])
            for k, (p, a, b, off) in enumerate(s.pieces):
                if k not in stepped:
                    for t in range(3):
                        after[t][off : off + b - a] = cur[t][off : off + b - a]
            self._native.load(i, *after)
            for k in stepped:
                s.steps[k] += 1
            cur, after = after, cur
        out.copy_(cur[0])

    def _out_for(self, s: _SubGroup):
        """Where the kernel writes sub-group ``s``'s new params, whether that
        is the params themselves, and the pinned slot (CUDA params): a
        sub-group that is one piece of one live CPU param gets the param's
        own memory; otherwise a buffer of the params' dtype (bf16 and fp16
        params get the kernel's fused low-precision copy, as torch's cast
        rounds it), scattered after; with CUDA params that buffer is one of
        ``_CudaCopies``' pinned pair."""
        homes = [(p, home_of(p)) for p, *_ in s.pieces]
        dtypes = {h.dtype if h is not None else p.dtype for p, h in homes}
        dt = dtypes.pop() if len(dtypes) == 1 else torch.float32
        if dt not in (torch.float32, torch.bfloat16, torch.float16):
            dt = torch.float32
        if len(s.pieces) == 1 and homes[0][1] is None:
            (p, a, b, _), = s.pieces
            if p.device.type == "cpu" and p.dtype == dt:
                return p.detach().view(-1)[a:b], True, None
        if self._copies is not None and any(p.device.type == "cuda" for p, *_ in s.pieces):
            buf, slot = self._copies.out_buffer(dt, s.numel)
            return buf, False, slot
        buf = self._out_bufs.get(dt)
        if buf is None:  # one per dtype, of the largest sub-group
            buf = self._out_bufs[dt] = torch.empty(self._largest, dtype=dt)
        return buf[: s.numel], False, None

    def _check_in_place(self, s):
        """A sub-group of the in-place path still fits it (fp32 params in
        host memory, not offloaded), or an error with the fix."""
        (p, *_), = s.pieces
        _not_offloaded(p)
        if p.device.type != "cpu" or p.dtype != torch.float32:
            # Chosen at construction, for fp32 params in host memory;
            # a model moved since (HF Trainer and accelerate's
            # prepare() move it after an optimizer given to them was
            # built) failed deep in the kernel's DLPack import.
            raise RuntimeError(
                f"tierzero.torch.AdamW was built over fp32 CPU params (stepped in place), "
                f"and a param is now {p.dtype} on {p.device}: build the optimizer after "
                f"moving the model, or with offload=\"nvme\" (which copies to and from any "
                f"device)"
            )

    def _step_in_place(self, todo):
        """The in-place host path: every sub-group of ``todo`` in one call."""
        work = []
        for i in todo:
            s = self._subgroups[i]
            self._check_in_place(s)
            # One piece, the whole param: its count is the param's.
            work.append((i, s.steps[0] + 1, *self._hyper(s), self._gather_grads(s)))
        self._native.step_groups(work)
        for i in todo:
            self._subgroups[i].steps[0] += 1
            self._stepped.add(i)
            for p, *_ in self._subgroups[i].pieces:
                _bump_version(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [
            i
            for i, s in enumerate(self._subgroups)
            if i not in self._stepped and any(p.grad is not None for p, *_ in s.pieces)
        ]
        # Checked before any sub-group steps, as torch checks before it
        # updates anything: a refusal part-way left the ones before it
        # stepped.
        for i in todo:
            for p, *_ in self._subgroups[i].pieces:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("tierzero.torch.AdamW does not support sparse gradients")
            if self._inplace:
                self._check_in_place(self._subgroups[i])
            # A group's hyper-parameters, as the kernel reads them (an LR
            # scheduler or a user may have set them since): on the nvme
            # path a bad one raised after the groups before it stepped.
            self._check_hyper(self._subgroups[i])
        for p in self._empty_steps:
            if p.grad is not None:
                self._empty_steps[p] += 1
        try:
            if self._inplace:
                self._step_in_place(todo)
            else:
                for k, i in enumerate(todo):
                    self._step_one(i, todo[k + 1] if k + 1 < len(todo) else None)
            self._native.flush()
            self._finish_copies()
            self._note_steps()
        finally:
            # A step that raised is over too: the next one steps every
            # sub-group with a gradient (one stepped before the error
            # included, as torch would step it again).
            self._stepped.clear()
            if self.step_in_backward:
                self._reset_waiting()
        return loss

    # Step in backward (register_post_accumulate_grad_hook).
    def _reset_waiting(self, todo=None):
        """Every param of each sub-group (of ``todo``, else all) is waited
        for again."""
        for i in range(len(self._subgroups)) if todo is None else todo:
            self._waiting[i] = {id(p) for p, *_ in self._subgroups[i].pieces if p.requires_grad}

    @torch.no_grad()
    def _grad_final(self, p):
        """A param's gradient is final for this backward: step every
        sub-group of it whose params are all final, guessing that the one
        before it comes next (backward runs the model in reverse)."""
        try:
            for i in self._param_sgs.get(p, ()):
                if i in self._stepped and p.grad is not None:
                    # A second backward before step(): its gradient would be
                    # skipped by step() and zeroed, silently training on the
                    # first micro-batch alone.
                    raise RuntimeError(
                        "tierzero.torch.AdamW(step_in_backward=True) stepped this param in the last "
                        "backward, and another backward came before step() (gradient accumulation): "
                        "use step_in_backward=False with gradient accumulation, or accumulate 1 step"
                    )
                w = self._waiting[i]
                w.discard(id(p))
                if not w and i not in self._stepped:
                    self._step_one(i, i - 1 if i > 0 else None, in_backward=True)
                    # Free the gradients no other pending sub-group needs.
                    for q, *_ in self._subgroups[i].pieces:
                        if all(j in self._stepped for j in self._param_sgs[q]):
                            q.grad = None
        except BaseException:
            # The error ends this backward: the sub-groups it did not step
            # wait for all their params again. Else the next backward (after
            # a non-finite gradient was refused) stepped a sub-group at its
            # first param's hook, before the others' gradients were final,
            # or took it for a second backward before step().
            self._reset_waiting(i for i in range(len(self._subgroups)) if i not in self._stepped)
            raise

    def remove_hooks(self):
        """Removes the step-in-backward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # torch's state_dict format.
    def _param_states(self):
        """{param: {"step", "exp_avg", "exp_avg_sq"[, "master"]}} from every
        sub-group; empty before the first step, as torch's (accelerate's
        ``prepare`` round-trips the state dict through the device: the
        state of a model that has not stepped is not materialised)."""
        out = {}
        stepped = any(any(s.steps) for s in self._subgroups)
        for i, s in enumerate(self._subgroups if stepped else ()):
            if not self._inplace:
                # Params changed since their last step (frozen ones loaded,
                # edited ones) are the master's now: it was saved stale and
                # written back over them by a load.
                self._adopt_changed(i, s)
            master = torch.empty(s.numel, dtype=torch.float32)
            m = torch.empty_like(master)
            v = torch.empty_like(master)
            self._native.read_state(i, master, m, v)
            for (p, a, b, off), n in zip(s.pieces, s.steps):
                st = out.get(p)
                if st is not None:
                    # A param over several sub-groups: its pieces step
                    # together, but one stepped before a step that raised
                    # may be ahead; the param's count is its latest.
                    st["step"].fill_(max(float(n), st["step"].item()))
                else:
                    st = {
                        "step": torch.tensor(float(n)),
                        "exp_avg": torch.zeros(_shape(p).numel(), dtype=torch.float32),
                        "exp_avg_sq": torch.zeros(_shape(p).numel(), dtype=torch.float32),
                    }
                    if p.dtype != torch.float32:
                        st["master"] = torch.zeros(_shape(p).numel(), dtype=torch.float32)
                    out[p] = st
                st["exp_avg"][a:b] = m[off : off + b - a]
                st["exp_avg_sq"][a:b] = v[off : off + b - a]
                if "master" in st:
                    st["master"][a:b] = master[off : off + b - a]
        for p, steps in self._empty_steps.items():
            if steps:
                out[p] = {
                    "step": torch.tensor(float(steps)),
                    "exp_avg": torch.zeros(p.shape, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32),
                }
        for p, st in out.items():
            for key in ("exp_avg", "exp_avg_sq", "master"):
                if key in st:
                    st[key] = st[key].view(_shape(p))
        return out

    def state_dict(self):
        # torch's state-dict hooks (register_state_dict_pre_hook / _post_hook),
        # in its order: pre-hooks first, a post-hook may return a new dict.
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _state_dict(self):
        states = self._param_states()
        index = {}
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                g["params"].append(index[id(p)])
            groups.append(g)
        by_id = {id(p): p for group in self.param_groups for p in group["params"]}
        state = {index[pid]: states[by_id[pid]] for pid in index if by_id[pid] in states}
        return {"state": state, "param_groups": groups}

    def _check_loadable(self):
        """Before a load changes anything: the in-place path's params are
        not offloaded (``_not_offloaded``)."""
        for p in self._native._params if self._inplace else ():
            _not_offloaded(p)

    def load_state_dict(self, state_dict):
        # torch's load hooks, in its order: a pre-hook may return a new
        # dict (of a shallow copy, as torch makes), post-hooks after.
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @torch.no_grad()
    def _load_state_dict(self, state_dict):
        self._check_loadable()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups, the optimizer has {len(self.param_groups)}"
            )
        params = {}
        for mine, saved in zip(self.param_groups, groups):
            if len(mine["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded state dict has a group of {len(saved['params'])} params where the optimizer has {len(mine['params'])}"
                )
            for idx, p in zip(saved["params"], mine["params"]):
                params[p] = state_dict["state"].get(idx, state_dict["state"].get(str(idx)))
        # Another param's state (another model's, or groups in another
        # order) was sliced to this one's size: refused before anything,
        # hyper-parameters included, is loaded.
        for p, st in params.items():
            for key in ("exp_avg", "exp_avg_sq", "master"):
                t = st.get(key) if st else None
                if t is not None and t.numel() != _shape(p).numel():
                    raise ValueError(
                        f"loaded state's {key!r} has {t.numel()} elements (shape "
                        f"{tuple(t.shape)}) for a param of shape {tuple(_shape(p))}: the state "
                        f"dict is another model's, or its param groups are in another order"
                    )
        for mine, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        for p, st in params.items():
            if p in self._empty_steps:
                self._empty_steps[p] = int(float(st["step"])) if st else 0
        self._stale.clear()  # every master is loaded and scattered below
        for i, s in enumerate(self._subgroups):
            master = torch.empty(s.numel, dtype=torch.float32)
            m = torch.zeros_like(master)
            v = torch.zeros_like(master)
            for k, (p, a, b, off) in enumerate(s.pieces):
                st = params.get(p)
                src = st.get("master") if st else None
                if src is None:
                    src = _values(p)
                master[off : off + b - a] = src.reshape(-1)[a:b].float().cpu()
                if st:
                    m[off : off + b - a] = st["exp_avg"].reshape(-1)[a:b].float().cpu()
                    v[off : off + b - a] = st["exp_avg_sq"].reshape(-1)[a:b].float().cpu()
                # Each piece its param's count (torch's per-param step).
                s.steps[k] = int(float(st["step"])) if st else 0
            self._native.load(i, master, m, v)
            self._scatter_params(s, master)
        self._finish_copies()
        self.state.clear()
        self._note_steps()

    # Streaming checkpoints: one sub-group in memory at a time. The file is
    # laid out by param, not by sub-group (three sections, master, m and v,
    # each the params' flat values in param_groups order), so it loads into
    # any tier and any sub_group_size.
    def _flat_offsets(self):
        offsets, total = {}, 0
        for g in self.param_groups:
            for p in g["params"]:
                offsets[id(p)] = total
                total += _shape(p).numel()
        return offsets, total

    def save_checkpoint(self, path):
        """Writes the whole optimizer state to ``path`` (atomically: a temp
        file ``<path>.tmp.<pid>``, fsync, rename, fsync of the directory),
        one sub-group at a time. A save killed mid-write leaves its temp
        file, the state's size: this save (and a ``load_checkpoint`` of
        ``path``) removes the temps of ``path`` whose writer is gone, with a
        warning. The writer holds its temp's lock (flock) until the rename,
        which tells them apart from a save in progress, in this process or
        another (``_remove_stale_temps``)."""
        path = os.fspath(path)
        _remove_stale_temps(path)
        offsets, total = self._flat_offsets()
        # Each piece's step count at its flat start: a param over two
        # sub-groups may have stepped in one of them only (a step that
        # raised part-way), and each param of a sub-group has its own.
        # (Checkpoints written when a sub-group kept one count have that
        # count at each of its pieces' starts: each param is loaded with
        # its sub-group's count, as it was stepped.)
        steps = {}
        for s in self._subgroups:
            for (p, a, *_), n in zip(s.pieces, s.steps):
                steps[offsets[id(p)] + a] = n
        header = {
            "numel": total,
            "steps": sorted(steps.items()),
            # The groups' sizes in elements: a load into other groups (the
            # same total) is refused rather than read across them.
            "group_numels": [sum(_shape(p).numel() for p in g["params"]) for g in self.param_groups],
            "param_groups": [
                {k: _plain(v) for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }
        head = json.dumps(header).encode()
        base = len(_MAGIC) + 8 + len(head)
        tmp = f"{path}.tmp.{os.getpid()}"
        largest = max((s.numel for s in self._subgroups), default=0)
        buf = [torch.empty(largest, dtype=torch.float32) for _ in range(3)]
        held = None
        try:
            # Created, locked and counted this process's in one step for
            # the sweep: another thread's never finds it unheld.
            with _SAVING_LOCK:
                f = open(tmp, "wb")
                try:
                    try:
                        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        pass  # no locks here (some NFS mounts): the sweep keeps temps there
                    st = os.fstat(f.fileno())
                except BaseException:
                    f.close()
                    raise
                held = (st.st_dev, st.st_ino)
                _SAVING.add(held)
            with f:
                f.write(_MAGIC + len(head).to_bytes(8, "little") + head)
                f.truncate(base + 12 * total)
                for i, s in enumerate(self._subgroups):
                    if not self._inplace:
                        self._adopt_changed(i, s)  # as _param_states does
                    views = [b[: s.numel] for b in buf]
                    self._native.read_state(i, *views)
                    for k, t in enumerate(views):
                        for p, a, b, off in s.pieces:
                            f.seek(base + 4 * (k * total + offsets[id(p)] + a))
                            f.write(t[off : off + b - a].numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())
                # Renamed while its lock is held: a sweep never takes a
                # finished temp for a stale one.
                os.replace(tmp, path)
        except BaseException:
            # A failed save (a state read, a full disk) leaves no
            # model-sized temporary file beside ``path``.
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            raise
        finally:
            _SAVING.discard(held)
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    @torch.no_grad()
    def load_checkpoint(self, path):
        """Loads what ``save_checkpoint`` wrote, one sub-group at a time, and
        sets the params to the saved master weights. Temps of saves of
        ``path`` killed mid-write are removed first, as a save removes
        them."""
        self._check_loadable()
        _remove_stale_temps(path)
        offsets, total = self._flat_offsets()
        with open(path, "rb") as f:
            if f.read(8) != _MAGIC:
                raise ValueError(f"{path}: not a tierzero AdamW checkpoint")
            head_len = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            # A damaged length (or file) is said, not a MemoryError from
            # reading a length that is not there, or a JSON or Key error.
            if head_len > size - len(_MAGIC) - 8:
                raise ValueError(
                    f"{path}: damaged (its header says {head_len} bytes, the file has {size})"
                )
            try:
                head = json.loads(f.read(head_len))
                head["numel"], head["param_groups"], head["steps"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: damaged (its header does not read: {e})") from None
            if head["numel"] != total:
                raise ValueError(
                    f"{path}: saved state of {head['numel']} elements, this optimizer's params have {total}; build it with the same params"
                )
            base = len(_MAGIC) + 8 + head_len
            groups = [sum(_shape(p).numel() for p in g["params"]) for g in self.param_groups]
            saved_groups = head.get("group_numels")
            if len(head["param_groups"]) != len(self.param_groups) or (
                saved_groups is not None and saved_groups != groups
            ):
                raise ValueError(
                    f"{path}: saved for param groups of {saved_groups or len(head['param_groups'])} "
                    f"elements, this optimizer's are {groups}; build it with the same param groups"
                )
            # Checked before anything changes: a truncated file loaded
            # the sub-groups before the cut, and raised.
            if size < base + 12 * total:
                raise ValueError(
                    f"{path}: truncated ({size} bytes, the state of {total} elements needs "
                    f"{base + 12 * total})"
                )
            starts = sorted((int(k), v) for k, v in head["steps"])
            keys = [k for k, _ in starts]

            def steps_in(lo, hi):
                """The saved step count of flat ``[lo, hi)``: of the saved
                piece holding ``lo``, or the latest of the saved pieces it
                overlaps (saved under another ``sub_group_size``, a piece
                may span several; a param's pieces have one count but
                after a step that raised part-way)."""
                first = max(bisect.bisect_right(keys, lo) - 1, 0)
                last = bisect.bisect_left(keys, hi)
                return max((n for _, n in starts[first:last]), default=0)

            for g, src in zip(self.param_groups, head["param_groups"]):
                g.update(src)
            self._stale.clear()  # every master is loaded (and scattered) below
            for i, s in enumerate(self._subgroups):
                t = [torch.empty(s.numel, dtype=torch.float32) for _ in range(3)]
                for k in range(3):
                    for p, a, b, off in s.pieces:
                        f.seek(base + 4 * (k * total + offsets[id(p)] + a))
                        raw = f.read(4 * (b - a))
                        if len(raw) != 4 * (b - a):
                            raise ValueError(f"{path}: truncated")
                        t[k][off : off + b - a] = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                self._native.load(i, *t)
                s.steps[:] = [steps_in(offsets[id(p)] + a, offsets[id(p)] + b) for p, a, b, _ in s.pieces]
                if not self._inplace:
                    self._scatter_params(s, t[0])
        self.state.clear()
        self._note_steps()

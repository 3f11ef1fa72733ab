"""``offload_parameters``: ZeRO-3 parameter offload for any ``nn.Module``.

For one process. Under ``DistributedDataParallel`` (torchrun's ranks, HF
Trainer's multi-process runs), whether DDP wraps the model before or after
the offload, backward fails inside torch ("TBackward0 returned an invalid
gradient ... expected shape compatible with [0]"), so the offload refuses
where ``torch.distributed`` is initialised with a world size above 1 or the
launcher's ``WORLD_SIZE`` says more than 1 (``offload_parameters``, and each
forward's first hook, for a process group initialised after it). With
several ranks, offload the params with DeepSpeed's own engine, on
tierzero's I/O through ``tierzero.deepspeed.install()``;
``tierzero.torch.AdamW`` itself runs under DDP (each rank's state under
``<nvme_path>/rank<R>``).

DeepSpeed's mechanism, on tierzero's I/O:

- every param but the persistent ones (DeepSpeed's rule: at most
  ``param_persistence_threshold`` elements, within
  ``model_persistence_threshold`` in all, in ``named_parameters`` order)
  gets a home on its tier: a host copy (``device="cpu"``; pageable memory, so a CUDA param's
  fetch is a blocking copy) or a region of one file under ``nvme_path`` (``"nvme"``, through
  ``tierzero.aio``, O_DIRECT, 4096-aligned regions);
- a forward pre-hook on each module that owns params fetches them
  (``param.data`` becomes the full tensor again), after first issuing the
  reads of the params the next modules of the recorded module trace need,
  up to ``prefetch_bucket_size`` elements and while fewer than
  ``max_live_parameters`` elements are live;
- a forward hook releases them (``param.data`` becomes an empty tensor, so
  the memory goes back) and wraps the module's outputs (each tensor that
  needs a gradient, at any depth of tuples, lists and dicts: an LSTM's
  ``(out, (h, c))``) in an autograd function whose backward fetches them
  again before the module's backward runs;
- a module whose forward reads its children's params without calling
  them fetches all of its params at once: ``nn.MultiheadAttention``
  (``out_proj``), ``nn.TransformerEncoderLayer`` (its fast path in
  eval; a ``TransformerDecoderLayer`` has none, and its attention is an
  ``nn.MultiheadAttention``), and the types given as
  ``whole_modules`` (DeepSpeed's ``register_external_parameter`` covers
  the same case, param by param). A param read outside any forward (a
  regulariser's ``p.pow(2).sum()``, ``p.numel()``) is the released, empty
  one: read it inside ``handle.gathered()``;
- a post-accumulate-grad hook releases each param once its gradient is
  final; a frozen param (``requires_grad=False``: a LoRA's base weights),
  which gets none, is released once its module's backward is done, by an
  identity function on the module's grad-requiring positional inputs
  (passed as keywords, or with no input needing a gradient, it stays live
  until the module's next forward);
- a fetch puts the values on the param's device now and checks its dtype:
  ``model.to(device)`` after the offload is followed, a cast is refused
  (by the forward, ``state_dict()``, ``gathered()`` and ``copy.deepcopy``
  alike: the homes hold the old dtype; ``remove()`` gives the plain model
  the cast made);
- a forward run inside a backward (gradient checkpointing's recompute,
  reentrant or not; HF's ``gradient_checkpointing_enable()`` is the
  non-reentrant one) keeps its params live until they are released as
  above (gradient final; a frozen one, its module's backward done): the
  non-reentrant recompute's saved tensors, a frozen param itself among
  them, are read by the original graph's backward, and its gradient
  accumulation reads the param. A param not released so in that backward
  (``torch.autograd.grad`` of other inputs; a frozen one whose module's
  inputs need no gradient) goes at its module's next forward;
- every tensor that may become a param's data (a fetch, an NVMe prefetch
  buffer, the released placeholder) is made outside inference mode, so an
  eval forward under ``torch.inference_mode()`` leaves none behind for the
  next training step; the forward hooks run outside ``torch.compile``'s
  tracing (eagerly between its graphs).

Params used by several modules (tied embeddings) are counted: each fetch
takes a reference, each release drops one, and the data goes only at zero.
The values are never changed by the round trip (bytes in, bytes out), so a
run with offload is bit-identical to one without.

The optimizer must update the params where they live: ``tierzero.torch.AdamW``
does (it reads and writes a released param through its home), built after
``offload_parameters`` (one built before steps fp32 CPU params in their own
memory, and is refused with that fix once they are offloaded). Another
optimizer needs the params gathered around its step (``with
handle.gathered(): opt.step()``), which holds the whole model for that time.

``model.state_dict()`` holds every param's values (a released one's read
from its home), and ``model.load_state_dict()`` writes into the homes, so
HF's ``save_model``, its checkpoints and its resume work on an offloaded
model (a released param's empty data was saved as a 0-element tensor, and
refused as a load's target).

``model.load_state_dict(sd, assign=True)`` is refused: it would put new,
full, unhooked Parameters in the model (the offload silently off, the
optimizer's params no longer the model's).

``copy.deepcopy`` of the model, or of any module of it holding offloaded
params or the offload's hooks (``AveragedModel``, an EMA or reference copy,
a container holding the model) gives a plain copy, as ``remove()`` would
leave it: every param's current values, full, tied params tied, none of the
offload's hooks; the original stays offloaded. (``copy.deepcopy`` finds a
``__deepcopy__`` that the offload puts in each such module's ``__dict__``;
``remove()`` takes it out.) ``AveragedModel.update_parameters(model)`` reads
the model's params, so it is called gathered: ``with handle.gathered():
ema.update_parameters(model)``. Pickling an offloaded model
(``torch.save(model)``) is refused with a ``TypeError`` naming the fixes:
save ``model.state_dict()``, or ``remove()`` first (a pickle of a plain
copy would hold the whole model in memory twice, and split tied params
between modules pickled apart).

``tierzero.torch.AdamW`` holds the offload of the params it is given, so a
model dropped before its optimizer leaves them their values.

``handle.remove()`` gathers every param for good and removes the hooks.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import importlib
import itertools
import os
import re
import stat
import sys
import threading
import warnings
import weakref

import torch

from .aio import aio_handle

__all__ = ["offload_parameters", "ParamOffload", "home_of"]

_ALIGN = 4096
# id(param) -> its _Home, for tierzero.torch.AdamW (tensors compare
# elementwise, so they cannot be dict keys themselves). Weak: a model
# dropped without ``remove()`` (HF's recipe, a sweep in one process) takes
# its homes, host copies and file with it; its offload holds them.
_HOMES: "weakref.WeakValueDictionary[int, _Home]" = weakref.WeakValueDictionary()


def home_of(param):
    """The offload home of ``param`` (None if it is not offloaded)."""
    h = _HOMES.get(id(param))
    return h if h is not None and h.param is param else None


def _no_dynamo(fn):
    """``fn`` kept out of ``torch.compile``'s tracing (run eagerly, a graph
    break). torch's lazy form imports dynamo at the first call, not at
    tierzero's import. (A wrapper that called ``fn`` directly outside a
    compile was itself a frame dynamo recompiled for every module, up to
    its recompile limit.)"""
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is not None:
        return lazy(fn)
    disable = getattr(getattr(torch, "compiler", None), "disable", None)  # an older torch
    if disable is None:
        disable = importlib.import_module("torch._dynamo").disable
    return disable(fn)


_NO_PICKLE = (
    "an offloaded model cannot be pickled (torch.save(model), pickle.dumps): its released params "
    "are empty placeholders and its hooks hold the offload's I/O; save model.state_dict() (it "
    "holds every param's values), or call remove() on the offload_parameters handle first "
    "(copy.deepcopy(model) gives a plain, not offloaded copy)"
)


def _check_dtype(h):
    """Refuses a param cast after the offload: its home holds the old
    dtype, which a fetch, a ``state_dict()`` or a copy would mix in."""
    if h.param.dtype != h.dtype:
        raise RuntimeError(
            f"offload_parameters: a param of {h.numel} elements was offloaded as {h.dtype} and "
            f"is now {h.param.dtype} (the model was cast after offload_parameters): cast the "
            f"model before offload_parameters"
        )


class _Home:
    """Where one param lives between uses, and its live references."""

    __slots__ = (
        "param", "owner", "shape", "dtype", "numel", "host", "offset", "refs", "inflight", "loads",
        "live_version", "__weakref__",
    )

    def __init__(self, param, owner):
        self.param = param
        self.owner = owner
        self.shape = param.shape
        self.dtype = param.dtype
        self.numel = param.numel()
        self.host = None  # "cpu": the host copy
        self.offset = None  # "nvme": offset in the file
        self.refs = 0
        self.inflight = None  # "nvme": tensor being read
        # Writes into it from outside the optimizer (``model.load_state_dict``,
        # an in-place change while gathered): an optimizer whose master copy
        # was taken before one reads the param again.
        self.loads = 0
        # The param's version when it was made live: changed at release, it
        # was written in place while live (a clamp_ in ``gathered()``).
        self.live_version = None

    @property
    def device(self):
        """Where the param's values go when fetched: its device now, which
        ``model.to(device)`` changes through its empty tensor (HF Trainer
        moves the model after it was offloaded)."""
        return self.param.device

    @property
    def nbytes(self):
        return self.numel * self.param.element_size()

    def is_live(self):
        return self.param.data.numel() == self.numel and self.numel > 0

    def read_into(self, out):
        """The param's current values into ``out`` (a contiguous tensor of its
        numel): from the live data, or from its home."""
        if self.is_live():
            out.copy_(self.param.data.reshape(-1))
        else:
            out.copy_(self.owner._load(self).reshape(-1))

    def write_from(self, src, start=0):
        """Sets ``[start, start + len(src))`` of the param's flat values, live
        or at home."""
        if self.is_live():
            self.param.data.view(-1)[start : start + src.numel()].copy_(src)
        if self.host is not None:
            self.host.view(-1)[start : start + src.numel()].copy_(src)
        elif self.offset is not None and not self.is_live():
            self.owner._store_range(self, src, start)
        elif self.offset is not None:
            self.owner._dirty.add(self)


class _InBackward(torch.autograd.Function):
    """Identity on ``tensors``; its backward calls ``fn`` first: on a
    module's outputs, fetching its params before the module's backward;
    on its inputs, releasing its frozen params after it."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        # Detached, as DeepSpeed's PreBackwardFunction: a view made in a
        # custom Function may not be changed in place (ReLU(inplace=True)
        # after an offloaded Linear raised); the version counter is shared,
        # so an in-place change backward needs is still caught.
        out = tuple(t.detach() for t in tensors)
        return out if len(out) != 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


#: Module types whose forward reads their children's params without
#: calling the children: their params are fetched as one (``whole_modules``
#: adds more).
_WHOLE_MODULES = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
)


class ParamOffload:
    """The hooks and homes of one model's offloaded params (see module docs)."""

    def __init__(
        self,
        model,
        device="cpu",
        nvme_path=None,
        prefetch_bucket_size=50_000_000,
        max_live_parameters=1_000_000_000,
        param_persistence_threshold=100_000,
        model_persistence_threshold=sys.maxsize,
        aio=None,
        whole_modules=(),
    ):
        _refuse_multiprocess()
        if device not in ("cpu", "nvme"):
            raise ValueError(f"device {device!r}: expected \"cpu\" or \"nvme\"")
        if device == "nvme" and nvme_path is None:
            raise ValueError("device=\"nvme\" needs nvme_path (a directory on the NVMe)")
        self.model = model
        self.device = device
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live_parameters = int(max_live_parameters)
        self.persistence_threshold = int(param_persistence_threshold)
        self.model_persistence_threshold = int(model_persistence_threshold)
        self._aio = aio if aio is not None else (aio_handle() if device == "nvme" else None)
        self._file = None
        self._dirty = set()
        self._hooks = []
        self._trace: list = []  # modules in the order their forward ran
        self._trace_pos: dict = {}
        self._recording = True
        self._step_in_trace = 0
        self.fetched_bytes = 0
        self.prefetched = 0
        # Homes: every param above the threshold, once (shared params too).
        self._module_homes: dict = {}
        seen = {}  # id(param) -> _Home
        # DeepSpeed's persistence rule, in named_parameters order: at most
        # the threshold's elements, within the model threshold in all (a
        # param that would pass it is homed; a later smaller one may fit).
        persistent = set()  # id(param)
        persistent_numel = 0
        offset = 0
        for module in model.modules():
            homes = []
            for p in module._parameters.values():
                # Before the size test: an offloaded param's placeholder is
                # empty, so a second offload_parameters of the model
                # skipped every param and offloaded nothing, silently.
                if p is not None and id(p) not in seen and home_of(p) is not None:
                    raise ValueError(
                        "a parameter is already offloaded by another offload_parameters; "
                        "call remove() on that one first"
                    )
                if p is None or id(p) in persistent:
                    continue
                if (
                    id(p) not in seen
                    and p.numel() <= self.persistence_threshold
                    and persistent_numel + p.numel() <= self.model_persistence_threshold
                ):
                    persistent.add(id(p))
                    persistent_numel += p.numel()
                    continue
                if id(p) not in seen:
                    h = _Home(p, self)
                    if device == "nvme":
                        h.offset = offset
                        offset += -(-h.nbytes // _ALIGN) * _ALIGN
                    seen[id(p)] = h
                homes.append(seen[id(p)])
            if homes:
                self._module_homes[module] = homes
        # A module whose forward reads its children's params without
        # calling them (``nn.MultiheadAttention``'s ``out_proj``, a
        # Transformer layer's fast path) fetches them all itself; the
        # children keep their own hooks (each fetch takes a reference).
        whole = tuple(_WHOLE_MODULES) + tuple(whole_modules)
        for module in model.modules():
            if isinstance(module, whole):
                homes = {}
                for sub in module.modules():
                    for h in self._module_homes.get(sub, ()):
                        homes.setdefault(id(h), h)
                if homes:
                    self._module_homes[module] = list(homes.values())
        self._homes = list(seen.values())
        if device == "nvme":
            os.makedirs(nvme_path, exist_ok=True)
            # A killed process leaves its file (no finalizer runs): the
            # next offload in this directory removes the files nobody
            # holds (`_reclaim_stale`).
            _reclaim_stale(nvme_path)
            self._file = os.path.join(nvme_path, f"tierzero-params-{os.getpid()}-{id(self):x}.bin")
            # Held (flock) while this offload lives: another process's
            # reclaim never takes it for a dead one's, whatever its pid
            # says there (another PID namespace, another host on a shared
            # file system).
            lock_fd = _hold(self._file)
            # Removed at exit when ``remove()`` was never called (HF's
            # recipe does not call it): a model-sized file was left in
            # ``nvme_path`` by every run.
            self._file_gone = weakref.finalize(self, _release_file, self._file, lock_fd)
        with torch.no_grad():
            for h in self._homes:
                if device == "cpu":
                    h.host = torch.empty(h.shape, dtype=h.dtype, device="cpu")
                    h.host.copy_(h.param.data)
                else:
                    self._io(self._aio.sync_pwrite, h.param.data.detach().reshape(-1).cpu().contiguous(), self._file, h.offset)
                _HOMES[id(h.param)] = h
                self._release(h, force=True)
        for module, homes in self._module_homes.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
            # Called when the forward raises too: a failed forward (an
            # OOM retry, a batch-size finder) left its params live, and under
            # no_grad nothing released them again (the offload was off).
            try:
                post = module.register_forward_hook(self._post_forward, always_call=True)
            except TypeError:  # a torch before always_call (2.1)
                post = module.register_forward_hook(self._post_forward)
            self._hooks.append(post)
            self._hooks.append(_state_dict_post_hook(module, self._state_dict_entries))
            self._hooks.append(_load_pre_hook(module, self._before_load))
        self._loading: list = []
        if model not in self._module_homes:
            # Refused at the root, before anything is assigned.
            self._hooks.append(_load_pre_hook(model, self._before_load))
        self._hooks.append(model.register_load_state_dict_post_hook(self._after_load))
        # ``copy.deepcopy`` looks ``__deepcopy__`` up on the instance: each
        # module that holds an offloaded param or a hook of this offload
        # copies itself as a plain module (``_deepcopy``), whichever of
        # them the copy starts at or reaches.
        self._copying = [model, *(m for m in self._module_homes if m is not model)]
        for module in self._copying:
            module.__dict__["__deepcopy__"] = functools.partial(self._deepcopy, module)
        for h in self._homes:
            if h.param.requires_grad:
                # Through a weak reference: a tensor's hooks are held from
                # C++, where the garbage collector does not see the cycle
                # param -> hook -> offload -> param, so a strong one kept
                # every dropped model alive.
                self._hooks.append(h.param.register_post_accumulate_grad_hook(_weakly(self._grad_final)))

    # Moving bytes.
    @torch.inference_mode(False)
    def _load(self, h):
        """The param's values from its home (a new tensor on its device).
        Made outside inference mode, as every tensor that may become a
        param's data (an inference tensor cannot be saved for backward: a
        fetch or prefetch under ``torch.inference_mode()`` broke the next
        training step)."""
        if h.host is not None:
            return h.host.to(h.device, copy=True)
        if h.inflight is not None:
            self._io(self._aio.wait)
            t, h.inflight = h.inflight, None
        else:
            t = torch.empty(h.shape, dtype=h.dtype, device="cpu")
            self._io(self._aio.sync_pread, t.reshape(-1), self._file, h.offset)
        self.fetched_bytes += h.nbytes
        return t.to(h.device) if h.device.type != "cpu" else t

    def _io(self, op, *args):
        """``op(*args)`` on the aio handle; every aio call goes through here.
        Its error may be a prefetch's (a sync op waits for every op in
        flight), or a read's that was never issued: then every op is waited
        for and no prefetch buffer may become a param's values (one left
        ``inflight`` was installed, unfilled, by the next fetch)."""
        try:
            return op(*args)
        except BaseException:
            try:
                self._aio.wait()
            except BaseException:
                pass
            for other in self._homes:
                other.inflight = None
            raise

    def _store_range(self, h, src, start):
        """Writes flat elements ``[start, start + len(src))`` of a released
        NVMe param: that range of its region only (``tierzero.aio`` takes
        any offset and length), not a read and rewrite of all of it for
        each optimizer sub-group the param is cut into."""
        if h.inflight is not None:
            # A prefetch of the old values: waited for, and dropped.
            self._io(self._aio.wait)
            h.inflight = None
        data = src.detach().to(h.dtype).reshape(-1).cpu().contiguous()
        self._io(self._aio.sync_pwrite, data, self._file, h.offset + start * h.param.element_size())

    def _fetch(self, h, count=True):
        """Makes the param live; ``count``: a forward use, dropped by its
        ``_release``."""
        if count:
            h.refs += 1
        if not h.is_live():
            h.param.data = self._load(h).view(h.shape)
            h.live_version = h.param._version

    def _release(self, h, force=False, keep=False):
        """Drops a forward use (or all, ``force``) and, at none left, the
        data; ``keep``: the data stays until the gradient is final
        (``_grad_final``), or to the next forward's release."""
        if not force:
            h.refs = max(0, h.refs - 1)
            if h.refs or keep:
                return
        if h.is_live() and h.live_version is not None and h.param._version != h.live_version:
            # Changed in place while live (a WGAN clamp, a re-init inside
            # ``gathered()``): written back, and the optimizer told, whose
            # master would otherwise step from the old values over it.
            h.loads += 1
            self._dirty.add(h)
        if h in self._dirty and h.is_live():
            if h.offset is not None:
                self._io(self._aio.sync_pwrite, h.param.data.detach().reshape(-1).cpu().contiguous(), self._file, h.offset)
            elif h.host is not None:
                # CPU homes: the live tensor is a copy of the home (on the
                # param's device), so a change made while gathered goes back.
                h.host.view(-1).copy_(h.param.data.detach().reshape(-1))
        self._dirty.discard(h)
        # Of the param's dtype: one cast after the offload stays so, and
        # refused (a refused forward's release turned it back, and the
        # next forward mixed dtypes).
        with torch.inference_mode(False):
            h.param.data = torch.empty(0, dtype=h.param.dtype, device=h.device)

    # state_dict() and load_state_dict(): a released param's data is an
    # empty tensor, which would be saved (HF's save_model, its periodic
    # checkpoints) and refused as a load's target.
    def _released_of(self, module, prefix, state_dict):
        """``(key, home)`` of ``module``'s own offloaded params in
        ``state_dict``."""
        for name, p in module._parameters.items():
            h = _HOMES.get(id(p)) if p is not None else None
            if h is not None and h.owner is self and prefix + name in state_dict:
                yield prefix + name, h

    def _state_dict_entries(self, module, state_dict, prefix, local_metadata):
        """A released param's entry becomes its values, read from its home."""
        for key, h in self._released_of(module, prefix, state_dict):
            # Its home holds the old dtype: a checkpoint of fp32 weights
            # and fp16 biases was saved after ``model.half()``.
            _check_dtype(h)
            if not h.is_live():
                state_dict[key] = self._load(h).view(h.shape)

    def _before_load(self, module, state_dict, prefix, local_metadata=None, *args):
        """Makes the loaded params live for torch's copy into them; they
        go back to their homes after the load (``_after_load``)."""
        if local_metadata and local_metadata.get("assign_to_params_buffers"):
            # It would put new, full, unhooked Parameters in the model: the
            # offload silently off, the optimizer's params no longer the
            # model's.
            raise RuntimeError(
                "offload_parameters: load_state_dict(..., assign=True) would replace the offloaded "
                "params and turn the offload off; load without assign=True (the values are written "
                "into the offloaded params' homes), or load before offload_parameters"
            )
        for _, h in self._released_of(module, prefix, state_dict):
            h.loads += 1
            if not h.is_live():
                self._fetch(h, count=False)
                self._loading.append(h)
            # A live param (used now, or gathered) keeps the loaded values
            # when it is released.
            self._dirty.add(h)

    def _after_load(self, module, incompatible_keys):
        loading, self._loading = self._loading, []
        for h in loading:
            if not h.refs:
                self._release(h, force=True)

    def live_numel(self):
        return sum(h.numel for h in self._homes if h.is_live())

    def _prefetch_after(self, module):
        """Issues the reads of the next modules' params (NVMe), up to the
        bucket and while the live elements stay under the limit."""
        if self.device != "nvme" or self._recording:
            return
        pos = self._trace_pos.get(module)
        if pos is None:
            return
        budget = self.prefetch_bucket_size
        live = self.live_numel()
        for nxt in itertools.islice(self._trace, pos + 1, None):
            for h in self._module_homes.get(nxt, ()):
                if h.is_live() or h.inflight is not None:
                    continue
                if budget < h.numel or live + h.numel > self.max_live_parameters:
                    return
                # Outside inference mode (see ``_load``): a module skipped
                # by an eval forward under ``torch.inference_mode()`` left
                # its buffer in flight for the next training forward.
                with torch.inference_mode(False):
                    buf = torch.empty(h.shape, dtype=h.dtype, device="cpu")
                # In flight once issued: a read that failed to issue left
                # its unfilled buffer to become the param at its fetch.
                self._io(self._aio.async_pread, buf.reshape(-1), self._file, h.offset)
                h.inflight = buf
                self.prefetched += 1
                budget -= h.numel
                live += h.numel

    # Hooks. Kept out of ``torch.compile``'s tracing: dynamo traced into
    # the aio calls of an NVMe fetch and failed; run eagerly between the
    # compiled graphs, they move the same bytes.
    @_no_dynamo
    def _pre_forward(self, module, args):
        if not self._trace or self._trace_pos.get(module) == 0:
            # Each forward's first hook: a process group initialised after
            # the offload (DDP wrapping the offloaded model) is refused
            # before anything is fetched.
            _refuse_multiprocess()
        if module in self._trace_pos and self._trace_pos[module] == 0 and self._trace:
            self._recording = False
        if self._recording and module not in self._trace_pos:
            self._trace_pos[module] = len(self._trace)
            self._trace.append(module)
        homes = self._module_homes[module]
        for h in homes:
            _check_dtype(h)
        for h in homes:
            self._fetch(h)
        self._prefetch_after(module)
        frozen = [h for h in homes if not h.param.requires_grad]
        if not frozen or not torch.is_grad_enabled():
            return None
        # The frozen params (a LoRA's base weights) have no gradient to
        # release them: they go once this module's backward is done, when
        # its grad-requiring positional inputs' gradients pass through
        # _InBackward.

        def release():
            for h in frozen:
                h.refs = 0
                self._release(h, force=True)

        # The inputs are the caller's: a list or dict among them is
        # copied, not changed.
        return _wrap(tuple(args), release, in_place=False)

    @_no_dynamo
    def _post_forward(self, module, args, output):
        homes = self._module_homes[module]
        # A forward run inside a backward is a checkpoint's recompute. The
        # non-reentrant one (torch.utils.checkpoint(use_reentrant=False),
        # HF's gradient checkpointing) saves, for the original graph's
        # backward, a detached alias of a grad-requiring param, whose
        # AccumulateGrad then reads the param itself (its shape, to lay out
        # the gradient), and a frozen param itself (a LayerNorm's weight):
        # released here, either was empty there. So the params stay live
        # until their gradients are final (``_grad_final``), a frozen one
        # until its module's backward is done (the original forward's
        # release on its inputs); the saved aliases held the memory for
        # that time anyway.
        recompute = torch.is_grad_enabled() and _in_backward()
        for h in homes:
            self._release(h, keep=recompute)
        if not torch.is_grad_enabled():
            return output

        def fetch():
            # Backward: live until its gradient is final (_grad_final).
            for h in homes:
                self._fetch(h, count=False)

        return _wrap(output, fetch)

    def _grad_final(self, p):
        h = home_of(p)
        if h is not None:
            h.refs = 0
            self._release(h, force=True)

    # Copies. ``copy.deepcopy(model)`` (EMA, ``AveragedModel``, a
    # reference model) copied the released params' empty placeholders and
    # this offload with them: a copy that trained and averaged silently
    # wrong, or failed on the aio handle.
    def _deepcopy(self, module, memo):
        """``copy.deepcopy(module)``: a plain module, as ``remove()`` would
        leave it (each param's current values, full; none of this
        offload's hooks), the original untouched. Its params come through
        ``memo``, so tied params stay tied; the offload is not copied."""
        memo[id(self)] = _NOT_COPIED
        for p in module.parameters():
            h = home_of(p)
            if h is None or h.owner is not self or id(p) in memo:
                continue
            _check_dtype(h)
            with torch.no_grad():
                values = h.param.data.clone() if h.is_live() else self._load(h).view(h.shape)
            memo[id(p)] = type(p)(values, p.requires_grad)
        # Taken off for the copy, so that the generic copy runs here (and
        # the copy does not get it).
        mine = module.__dict__.pop("__deepcopy__")
        try:
            new = copy.deepcopy(module, memo)
        finally:
            module.__dict__["__deepcopy__"] = mine
        ids = {hook.id for hook in self._hooks}
        for m in new.modules():
            m.__dict__.pop("__deepcopy__", None)
            for name, hooks in vars(m).items():
                if "hook" in name and isinstance(hooks, dict):
                    for i in ids & hooks.keys():
                        del hooks[i]
        return new

    def __deepcopy__(self, memo):
        raise TypeError(
            "a ParamOffload cannot be copied; copy.deepcopy(model) gives a plain (not offloaded) "
            "copy of the model"
        )

    def __reduce_ex__(self, protocol):
        raise TypeError(_NO_PICKLE)

    # Public.
    def gathered(self):
        """A context manager that keeps every param live inside it."""
        outer = self

        class _Gathered:
            def __enter__(self):
                for h in outer._homes:
                    # Checked first: a cast param made live from its home
                    # was silently cast back.
                    _check_dtype(h)
                for h in outer._homes:
                    outer._fetch(h)
                return outer.model

            def __exit__(self, *exc):
                for h in outer._homes:
                    outer._dirty.add(h)
                    outer._release(h)
                return False

        return _Gathered()

    def remove(self):
        """Gathers every param for good, removes the hooks and the file."""
        if self._aio is not None and self.device == "nvme":
            self._io(self._aio.wait)
        for h in self._homes:
            if not h.is_live():
                # A cast after the offload (refused by the forward, which
                # would mix dtypes) is the plain model's to make.
                h.param.data = self._load(h).view(h.shape).to(h.param.dtype)
            h.inflight = None
            _HOMES.pop(id(h.param), None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module in self._copying:
            module.__dict__.pop("__deepcopy__", None)
        self._copying = []
        self._homes = []
        if self._file:
            self._file_gone()


#: What this offload is copied as in a model's deep copy (its hooks are
#: then taken out of the copy).
_NOT_COPIED = object()


def _distributed():
    """``(rank, world size)`` where this process is one of several ranks:
    ``torch.distributed`` initialised with a world size above 1, or, before
    it is (HF Trainer initialises it after the model is built), the
    launcher's ``WORLD_SIZE`` above 1 (torchrun, DeepSpeed's launcher and
    accelerate set it, with ``RANK``; ``rank`` is None where ``RANK`` is
    not set). None for one process."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return (dist.get_rank(), world) if world > 1 else None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1:
        return None
    try:
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        rank = None
    return rank, world


def _refuse_multiprocess():
    """Refuses the param offload in one of several ranks (see the module
    docs)."""
    d = _distributed()
    if d is None:
        return
    rank, world = d
    raise RuntimeError(
        f"offload_parameters works in one process only, and this is rank "
        f"{'?' if rank is None else rank} of {world} (torch.distributed or WORLD_SIZE): under "
        f"DistributedDataParallel backward fails inside torch (\"invalid gradient ... expected "
        f"shape compatible with [0]\"), whether DDP wraps the model before or after the offload; "
        f"run one process, or offload the params with DeepSpeed's own engine (ZeRO-3 "
        f"offload_param) on tierzero's I/O through tierzero.deepspeed.install(); "
        f"tierzero.torch.AdamW alone works under DDP"
    )


def _in_backward():
    """Whether autograd's engine is running a backward on this thread (a
    checkpoint's recompute runs the forward there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _weakly(method):
    """``method`` called through a weak reference to its object (a no-op
    once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        return None if m is None else m(*args)

    return call


# The params files this process holds (``_hold``), by device and inode:
# the reclaim spares them whatever their lock says (on NFS, where flock is
# a POSIX lock, this process's own lock never stops its own reclaim), and
# nothing else of this process's pid. Reentrant: ``_release_file`` runs from
# a finalizer, which garbage collection may call inside ``_hold`` or the
# reclaim on the same thread.
_OWN_FILES: set = set()
_OWN_FILES_LOCK = threading.RLock()


def _hold(path):
    """Creates ``path``, takes its exclusive lock and counts it this
    process's (``_OWN_FILES``); returns the fd that holds it. A file
    system without locks (some NFS mounts) leaves the file unlocked: the
    reclaim cannot lock it there either, so it takes no file of such a
    directory."""
    with _OWN_FILES_LOCK:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        st = os.fstat(fd)
        _OWN_FILES.add((st.st_dev, st.st_ino))
    return fd


def _release_file(path, fd):
    """Removes ``path``, then lets go of its lock and of its place in
    ``_OWN_FILES``."""
    with _OWN_FILES_LOCK:
        try:
            st = os.fstat(fd)
            _OWN_FILES.discard((st.st_dev, st.st_ino))
            os.remove(path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


_PARAMS_FILE = re.compile(r"tierzero-params-([0-9]+)-[0-9a-f]+\.bin")


def _process_alive(pid):
    """Whether process ``pid`` exists. Only ``ESRCH`` proves it gone: one
    we may not signal counts as alive, so a file in use is never taken
    for a stale one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _open_in(pid, st):
    """Whether process ``pid`` of this host has the file of ``os.stat``
    result ``st`` open (one of its ``/proc/<pid>/fd``). A process whose fds
    cannot be read (another user's; no ``/proc``) has it open if it is
    alive: a file in use is never taken for a stale one."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return _process_alive(pid)
    for fd in fds:
        try:
            s = os.stat(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _remove_unlocked(folder, pattern, spared, who):
    """Removes the regular files in ``folder`` whose names ``pattern``
    matches in full (its group 1 the writer's pid) and whose lock (flock)
    is free: their writer is gone. Spared: those in ``spared`` (device and
    inode: this process's own, whose lock, a POSIX one on NFS, may not
    stop it) and those their pid's process has open on this host (its lock
    went with another fd of the file, or is not taken yet). The caller
    holds the lock that guards ``spared``. Returns ``(path, bytes)`` of
    each removed; a file it cannot remove is warned about (``who``'s)."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    own = os.getpid()
    for name in names:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, a link, not ours to read
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in spared:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: in use
            pid = int(m.group(1))
            if pid != own and _open_in(pid, st):
                continue
            os.remove(path)
        except OSError as e:
            warnings.warn(f"{who}: could not remove the stale file {path}: {e}", stacklevel=4)
            continue
        finally:
            os.close(fd)
        removed.append((path, st.st_size))
    return removed


def _reclaim_stale(nvme_path):
    """Removes the ``tierzero-params-<pid>-*.bin`` files in ``nvme_path``
    that nobody holds (a killed run's), with a warning naming them. A live
    offload holds its file's lock (``_hold``), which another PID namespace
    or host sharing the directory sees though its pid means nothing here: a
    file whose lock is free is stale, whatever process its pid names now.
    Pids are reused: a container restarted runs its trainer as pid 1 again,
    and its dead predecessor's model-sized file, named with pid 1, was kept
    for good as this process's own (or any live process's). Spared besides:
    the files this process holds (``_OWN_FILES``), and a file its pid's
    process has open on this host (on NFS, where flock is a POSIX lock,
    that process's lock went when it closed another fd of the file)."""
    with _OWN_FILES_LOCK:
        removed = _remove_unlocked(nvme_path, _PARAMS_FILE, _OWN_FILES, "offload_parameters")
    if removed:
        listed = ", ".join(f"{p} ({n} bytes)" for p, n in removed)
        warnings.warn(
            f"offload_parameters: removed {len(removed)} file(s) of processes that are gone: {listed}",
            stacklevel=3,
        )
    return removed


def _state_dict_post_hook(module, hook):
    """``hook(module, state_dict, prefix, local_metadata)`` after
    ``module``'s own entries are in its ``state_dict``."""
    register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
    return register(_Hook(hook))


class _Hook:
    """``fn`` as a hook that torch may mark with an attribute (a bound
    method takes none). Pickled, it refuses with the fix, as the offload
    does (a local function failed with a message naming neither); deep
    copied, it is itself (``_deepcopy`` takes it out of the copy)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NO_PICKLE)

    def __deepcopy__(self, memo):
        return self


def _load_pre_hook(module, hook):
    """``hook(module, state_dict, prefix, ...)`` before ``module``'s own
    entries are loaded."""
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is not None:
        return register(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def _map_tensors(value, fn, in_place=True):
    """``value`` with each tensor ``t`` in it replaced by ``fn(t)``: tensors
    at any depth of tuples (namedtuples and ``torch.return_types`` kept as
    their types), lists and dicts (changed in place, so a HF
    ``ModelOutput`` stays one; with ``in_place`` false, for a module's
    inputs, which are the caller's, copied first). Anything else is
    returned as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map_tensors(t, fn, in_place) for t in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if hasattr(value, "_fields"):
            return type(value)._make(items)
        if type(value) is tuple:
            return tuple(items)
        return type(value)(items)
    if isinstance(value, (list, dict)):
        keys = range(len(value)) if isinstance(value, list) else list(value.keys())
        out = value
        for k in keys:
            t = value[k]
            new = _map_tensors(t, fn, in_place)
            if new is not t:
                if out is value and not in_place:
                    out = copy.copy(value)
                out[k] = new
        return out
    return value


def _wrap(output, fetch, in_place=True):
    """``output`` with its grad-requiring tensors, at any depth of tuples,
    lists and dicts (an LSTM's ``(out, (h, c))``), passed through one
    _InBackward. One left out would reach the module's backward on its
    released (empty) params: an LSTM's crashed the process."""
    found = []

    def collect(t):
        if t.requires_grad:
            found.append(t)
        return t

    _map_tensors(output, collect, in_place)
    if not found:
        return output
    wrapped = _InBackward.apply(fetch, *found)
    it = iter(wrapped if len(found) != 1 else (wrapped,))
    return _map_tensors(output, lambda t: next(it) if t.requires_grad else t, in_place)


def offload_parameters(model, device=None, nvme_path=None, *, ds_config=None, **kw):
    """Offloads ``model``'s params (see the module docs); returns the
    ``ParamOffload`` whose ``remove()`` restores the model. ``ds_config``
    (a path or a dict) supplies ``offload_param.device`` / ``nvme_path``,
    ``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``,
    ``stage3_param_persistence_threshold`` and
    ``stage3_model_persistence_threshold`` where they are not given; one
    whose ``offload_param.device`` is ``"none"`` (or absent), with no
    ``device``, is a ``ValueError``. ``"auto"`` bucket and threshold are
    HF's rule (0.9 x hidden² and 10 x hidden elements, as ``tierzero
    train`` and HF's DeepSpeed integration fill them) of the model's
    ``config.hidden_size`` (a transformers model's); a model without one
    gets DeepSpeed's defaults, 50,000,000 and 100,000. One process only
    (see the module docs)."""
    if ds_config is not None:
        from .torch import _ds_settings

        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        s = _ds_settings(ds_config, hidden_size=hidden if isinstance(hidden, int) and hidden > 0 else None)
        if device is None:
            if s["param_offload"] == "none":
                # The config keeps the params on the device: offloading to
                # the CPU anyway (as it did) is not what it says.
                raise ValueError(
                    "ds_config's zero_optimization.offload_param.device is \"none\" (or absent): "
                    "it offloads no params; set it to \"cpu\" or \"nvme\", or pass device="
                )
            device = s["param_offload"]
        nvme_path = nvme_path if nvme_path is not None else s["param_nvme_path"]
        kw.setdefault("prefetch_bucket_size", s["prefetch_bucket_size"])
        kw.setdefault("max_live_parameters", s["max_live_parameters"])
        kw.setdefault("param_persistence_threshold", s["param_persistence_threshold"])
        kw.setdefault("model_persistence_threshold", s["model_persistence_threshold"])
    return ParamOffload(model, device or "cpu", nvme_path, **kw)

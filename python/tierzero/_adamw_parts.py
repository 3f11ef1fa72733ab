"""The parts of ``tierzero.torch.AdamW`` that are not the optimizer itself:
the in-place memory tier over fp32 CPU params (``_InPlaceState``, the
interface of ``_native._OffloadAdam``), the pinned copies of CUDA params'
gradients and new values (``_CudaCopies``), a sub-group's pieces
(``_SubGroup``), and the small helpers over a param that may be offloaded
(its values, shape and write mark). Private: ``tierzero.torch`` is the
surface.
"""

from __future__ import annotations

import json

import torch

from . import _native
from ._native import ds_offload_settings
from .offload import home_of


class _InPlaceState:
    """The memory tier over fp32 CPU params: the param is the master weight,
    ``m`` and ``v`` are tensors here (imported once into
    ``_native._InPlaceMoments``); the same SIMD kernel, stepped in place. The
    interface of ``_OffloadAdam``."""

    def __init__(self, subgroups, threads, moments_dtype=torch.float32):
        self._params = [s.pieces[0][0] for s in subgroups]
        self._m = [torch.zeros(s.numel, dtype=moments_dtype) for s in subgroups]
        self._v = [torch.zeros(s.numel, dtype=moments_dtype) for s in subgroups]
        # m and v imported once: they are never replaced, only copied into.
        self._moments = _native._InPlaceMoments(self._m, self._v)
        self._threads = threads

    def plan(self):
        n = sum(p.numel() for p in self._params)
        return (
            f"optimizer state in host memory, stepped in place on the fp32 params: {len(self._params)} params, "
            f"{n} elements, {self._m[0].element_size() * 2 * n if self._m else 0} bytes of "
            f"{self._m[0].dtype if self._m else 'no'} moments (the params are the master weights)"
        )

    def io_bytes(self):
        return (0, 0)

    def _flat(self, i):
        return _not_offloaded(self._params[i]).detach().view(-1)

    def load(self, i, master, m=None, v=None):
        self._flat(i).copy_(master)
        self._m[i].copy_(m) if m is not None else self._m[i].zero_()
        self._v[i].copy_(v) if v is not None else self._v[i].zero_()

    def read_state(self, i, master, m, v):
        master.copy_(self._flat(i))
        m.copy_(self._m[i])
        v.copy_(self._v[i])

    def step_group(self, i, step, lr, beta1, beta2, eps, weight_decay, grad, out, next=None):
        self.step_groups([(i, step, lr, beta1, beta2, eps, weight_decay, grad)])

    def step_groups(self, todo):
        """Steps several sub-groups in one native call (the kernel's threads
        are spawned once, not once per param): ``todo`` holds
        ``(i, step, lr, beta1, beta2, eps, weight_decay, grad)``."""
        self._moments.step_many(
            [(i, st, lr, b1, b2, eps, wd, self._params[i].detach(), g) for i, st, lr, b1, b2, eps, wd, g in todo],
            self._threads,
        )

    def flush(self):
        pass


class _CudaCopies:
    """The host side of CUDA params: gradients come down and new params go
    up through pinned buffers on a side stream, as DeepSpeed's CPU Adam
    does.

    - Gradients: the side stream first waits for the compute stream (the
      gradients, and any kernel still reading the params, were queued
      there), copies a sub-group's gradients into one pinned fp32 buffer,
      and is synchronised before Adam reads it.
    - New params: the kernel writes into one of two pinned buffers per
      dtype; its upload is queued on the side stream and an event recorded;
      that buffer is written again only once its event has completed, so
      the upload of sub-group ``i`` overlaps the step of ``i + 1`` and no
      buffer is overwritten while the copy engine reads it.
    - ``finish()``: the compute stream waits for the side stream (not the
      host), so the next forward sees every new param.
    """

    def __init__(self, largest):
        self.stream = torch.cuda.Stream()
        self.grad = torch.empty(largest, dtype=torch.float32, pin_memory=True)
        self._largest = largest
        self._out = {}  # dtype -> [(pinned buffer, event or None)] x 2
        self._turn = {}

    def gradients(self):
        """Context for the gradients' downloads: on the side stream, after
        the compute stream's queued work, synchronised on exit."""
        copies = self

        class _Down:
            def __enter__(self):
                copies.stream.wait_stream(torch.cuda.current_stream())
                self._ctx = torch.cuda.stream(copies.stream)
                self._ctx.__enter__()

            def __exit__(self, *exc):
                self._ctx.__exit__(*exc)
                copies.stream.synchronize()
                return False

        return _Down()

    def out_buffer(self, dtype, numel):
        """The next pinned output buffer of ``dtype``, once its last upload
        is done, and its slot (for ``uploaded``)."""
        slots = self._out.get(dtype)
        if slots is None:
            slots = self._out[dtype] = [
                [torch.empty(self._largest, dtype=dtype, pin_memory=True), None] for _ in range(2)
            ]
            self._turn[dtype] = 0
        k = self._turn[dtype]
        self._turn[dtype] = 1 - k
        buf, event = slots[k]
        if event is not None:
            event.synchronize()
            slots[k][1] = None
        return buf[:numel], slots[k]

    def upload(self, dst, src):
        """Queues ``dst.copy_(src)`` (``src`` pinned) on the side stream."""
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def uploaded(self, slot):
        """Records that the uploads queued so far read ``slot``'s buffer."""
        event = torch.cuda.Event()
        event.record(self.stream)
        slot[1] = event

    def finish(self):
        torch.cuda.current_stream().wait_stream(self.stream)


def _not_offloaded(p):
    """``p``, a param of the in-place path, which steps, loads and reads the
    param's own memory: one offloaded since the optimizer was built (its
    data is empty while released) is refused with the fix, where a step, a
    load or a state read failed on a size mismatch deep in the kernel or a
    copy."""
    home = home_of(p)
    if home is not None:
        raise RuntimeError(
            f"tierzero.torch.AdamW was built before offload_parameters: a param of {home.numel} "
            f"elements it steps in place is offloaded now; build tierzero.torch.AdamW after "
            f"offload_parameters"
        )
    return p


def _values(p):
    """A param's flat values, live or (offloaded and released) from its home."""
    home = home_of(p)
    if home is None or home.is_live():
        return p.detach().reshape(-1)
    out = torch.empty(home.numel, dtype=home.dtype, device=home.device)
    home.read_into(out)
    return out


def _shape(p):
    home = home_of(p)
    return home.shape if home is not None else p.shape


def _ds_settings(ds_config, given=None, hidden_size=None):
    """The settings of ``ds_config`` as the native reader resolves them;
    with ``given`` (AdamW's ``lr``, ``betas``, ``eps``, ``weight_decay``
    keywords, None where not given), its Adam/AdamW ``optimizer`` block
    resolved against them as HF Trainer's values; with ``hidden_size``
    (the model's), ``"auto"`` prefetch bucket and persistence threshold by
    HF's rule."""
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        text = json.dumps(ds_config)
    else:
        with open(ds_config, encoding="utf-8") as f:
            text = f.read()
    if given is None:
        s = ds_offload_settings(text, hidden_size=hidden_size)
    else:
        betas = given["betas"]
        s = ds_offload_settings(
            text,
            optimizer=True,
            lr=None if given["lr"] is None else float(given["lr"]),
            betas=None if betas is None else (float(betas[0]), float(betas[1])),
            eps=given["eps"],
            weight_decay=given["weight_decay"],
        )
    if s["unknown_keys"]:
        import warnings

        warnings.warn(f"ds_config: unknown keys ignored: {', '.join(s['unknown_keys'])}", stacklevel=3)
    return s


#: torch.optim.AdamW's defaults, where neither a keyword nor the
#: ds_config's ``optimizer`` block gives a value.
_TORCH_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _hyper(given, ds):
    """``lr``, ``betas``, ``eps`` and ``weight_decay``. With an Adam or
    AdamW ``optimizer`` block in the ds_config, the native reader resolved
    them as ``tierzero train`` does, the keywords given taking the place
    of HF Trainer's values (``"auto"`` takes a keyword's value, else HF's
    default; a block value that differs from a keyword is an error naming
    both; DeepSpeed's defaults where the block leaves a key out): those
    are used, and a variant this AdamW does not run (no
    ``bias_correction``; ``Adam`` with ``adam_w_mode: false`` and a
    weight decay, L2 rather than decoupled) is refused. Without a block,
    each keyword given, else torch's default. A block of another type is
    not used (a warning says so); a ``gradient_clipping`` the config sets
    is warned about: an optimizer does not clip, the trainer does."""
    import warnings

    out = dict(given)
    ignored = ds.get("optimizer_ignored")
    if ignored:
        warnings.warn(
            f"ds_config's optimizer.type is {ignored!r}: tierzero.torch.AdamW is AdamW, so the "
            f"block's params are not used; set optimizer.type to \"AdamW\" for them to be",
            stacklevel=3,
        )
    block = ds.get("optimizer")
    if block:
        for key in _TORCH_DEFAULTS:
            out[key] = block[key]
        refused = None
        if not block["bias_correction"]:
            refused = ("bias_correction is false", "tierzero's AdamW always corrects the moments' bias; remove it")
        elif not block["decoupled_weight_decay"] and float(out["weight_decay"]) != 0.0:
            refused = (
                f"adam_w_mode is false with a weight decay of {_plain(out['weight_decay'])} (L2 added "
                f"to the gradient)",
                "tierzero.torch.AdamW decays the weights decoupled (AdamW); remove adam_w_mode, or "
                "use torch.optim.Adam for L2",
            )
        if refused:
            raise ValueError(f"ds_config's optimizer.params.{refused[0]}: {refused[1]}")
    else:
        for key, default in _TORCH_DEFAULTS.items():
            if out[key] is None:
                out[key] = default
    clip = ds.get("gradient_clipping")
    if clip:
        warnings.warn(
            f"ds_config's gradient_clipping is {clip}: an optimizer cannot clip (DeepSpeed's engine "
            f"does, around its optimizer), and tierzero.torch.AdamW steps the gradients as they "
            f"are; clip before step(): HF Trainer's TrainingArguments(max_grad_norm={clip}) (its "
            f"default is 1.0), or torch.nn.utils.clip_grad_norm_(model.parameters(), {clip})",
            stacklevel=3,
        )
    return out


def _plain(v):
    """A param group's value as JSON holds it: a 0-d tensor (torch takes a
    tensor lr) as its number; the rest as it is."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def _bump_version(p):
    """Marks ``p`` written in place, as ``p.add_`` would: the kernel writes
    through its DLPack pointer, which torch does not see, so a graph that
    saved ``p`` before the step was backpropagated with the new values
    instead of raising torch's "modified by an inplace operation"."""
    torch.autograd.graph.increment_version(p)


def _write_mark(p):
    """What tells whether ``p`` changed since an optimizer wrote (or read)
    it: its version and storage, or, offloaded, the loads into its home."""
    home = home_of(p)
    if home is not None:
        return ("home", home.loads)
    return (p._version, p.data_ptr())


class _SubGroup:
    """Consecutive pieces of one param group's params, stepped together.

    ``steps`` holds a step count per piece, not one for the sub-group:
    torch counts each param's steps (``state[p]["step"]``) and advances it
    only when the param has a gradient, so a param that skipped steps
    beside others of its sub-group is bias-corrected with its own count
    (one count per sub-group corrected it with the others': 0.074 for a
    first step that should move 0.1 at lr 0.1)."""

    __slots__ = ("group", "pieces", "numel", "steps")

    def __init__(self, group):
        self.group = group
        self.pieces = []  # (param, start, end, offset in the sub-group)
        self.numel = 0
        self.steps = []  # per piece: its param's steps taken

    def add(self, p, start, end):
        """Appends ``p[start:end]`` as a piece that has not stepped."""
        self.pieces.append((p, start, end, self.numel))
        self.steps.append(0)
        self.numel += end - start

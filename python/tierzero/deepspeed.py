"""Run DeepSpeed's own DeepNVMe users on ``tierzero.aio``.

``install()`` makes ``deepspeed.ops.op_builder.AsyncIOBuilder().load()``
return the ``tierzero.aio`` module (``aio_handle``, ``aio_read``,
``aio_write``, ``deepspeed_memcpy``) and ``.is_compatible()`` return True,
so DeepSpeed's swappers (``deepspeed.runtime.swap_tensor``) and its
checkpoint writers (``deepspeed.io.FastFileWriter``, whose handle
``deepspeed.runtime.model_checkpointing`` builds) get our handle
without libaio and without a JIT build. ``uninstall()`` puts DeepSpeed's
methods back.

The patch lives in the process that called ``install()``. A process
DeepSpeed starts does not inherit it: ``ds_io`` (``deepspeed.nvme``) runs
its I/O in ``multiprocessing`` workers started with ``spawn``, and
``ds_nvme_tune`` runs ``ds_io`` as a command, so neither command gets our
handle (they load DeepSpeed's own op, which needs libaio and a JIT build).
``ds_io`` does from a script that calls ``install()`` at module level,
where each spawned worker, re-importing the script, runs it too::

    import tierzero.deepspeed
    tierzero.deepspeed.install()          # module level: the workers run it
    from deepspeed.nvme import ds_io_main

    if __name__ == "__main__":
        ds_io_main()                      # the same arguments as ds_io

(``install()`` under ``if __name__ == "__main__":`` patches the parent
alone: the workers load DeepSpeed's op, or fail to build it.)
``ds_nvme_tune`` has no such entry point. The same holds for any worker
process of one's own: each runs ``install()`` (at module level, or in its
initializer).

How DeepSpeed resolves the builder: ``deepspeed.ops.op_builder`` sets its
``AsyncIOBuilder`` attribute at import to the class the current accelerator
hands out (``get_accelerator().get_op_builder("AsyncIOBuilder")``): the
generic ``op_builder.async_io.AsyncIOBuilder`` on CUDA, the one in
``op_builder.cpu.async_io`` on the CPU accelerator, others on NPU / XPU.
Modules that did ``from deepspeed.ops.op_builder import AsyncIOBuilder``
(``deepspeed.ops.aio``, the swappers) hold that same class object, so we
patch the classes themselves, not the module attribute: the accelerator's
class, the module attribute's, and the generic and CPU ones where they
import. Subclasses (``GDSBuilder`` derives from the generic one) keep
DeepSpeed's behaviour: the patched methods act only on the exact classes
patched and hand everything else to the original.
"""

from __future__ import annotations

import importlib

__all__ = ["install", "uninstall", "installed"]

_MISSING = object()
# class -> {"load": original in the class dict (or _MISSING), "is_compatible": ...}
_PATCHED: dict[type, dict[str, object]] = {}


def _candidate_classes() -> list[type]:
    found: list[type] = []

    def add(c):
        if isinstance(c, type) and c not in found:
            found.append(c)

    try:
        from deepspeed.accelerator import get_accelerator

        add(get_accelerator().get_op_builder("AsyncIOBuilder"))
    except Exception:  # noqa: BLE001 (no accelerator: the other routes still work)
        pass
    ob = importlib.import_module("deepspeed.ops.op_builder")
    add(getattr(ob, "AsyncIOBuilder", None))
    for mod in ("deepspeed.ops.op_builder.async_io", "deepspeed.ops.op_builder.cpu.async_io"):
        try:
            add(getattr(importlib.import_module(mod), "AsyncIOBuilder", None))
        except Exception:  # noqa: BLE001 (an accelerator's package may not import here)
            pass
    return found


def _inherited(cls: type, name: str):
    """``cls.name`` as DeepSpeed defined it (ignoring our own patches)."""
    for base in cls.__mro__:
        if base in _PATCHED:
            orig = _PATCHED[base][name]
            if orig is not _MISSING:
                return orig
            continue
        if name in base.__dict__:
            return base.__dict__[name]
    raise AttributeError(name)


def _patched_load(self, verbose=False):
    if type(self) in _PATCHED:
        from . import aio

        return aio
    return _inherited(type(self), "load")(self, verbose=verbose)


def _patched_is_compatible(self, verbose=False):
    if type(self) in _PATCHED:
        return True
    return _inherited(type(self), "is_compatible")(self, verbose=verbose)


def install() -> list[type]:
    """Patches DeepSpeed's AsyncIOBuilder classes (idempotent); returns them.

    Raises ImportError when deepspeed is not installed."""
    classes = _candidate_classes()
    for cls in classes:
        if cls in _PATCHED:
            continue
        _PATCHED[cls] = {
            "load": cls.__dict__.get("load", _MISSING),
            "is_compatible": cls.__dict__.get("is_compatible", _MISSING),
        }
        cls.load = _patched_load
        cls.is_compatible = _patched_is_compatible
    return list(_PATCHED)


def uninstall() -> None:
    """Puts DeepSpeed's own ``load`` and ``is_compatible`` back."""
    for cls, orig in list(_PATCHED.items()):
        for name, fn in orig.items():
            if fn is _MISSING:
                if cls.__dict__.get(name) in (_patched_load, _patched_is_compatible):
                    delattr(cls, name)
            else:
                setattr(cls, name, fn)
        del _PATCHED[cls]


def installed() -> bool:
    return bool(_PATCHED)

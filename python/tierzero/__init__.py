"""tierzero for Python: NVMe I/O on io_uring, and offloaded training state.

- ``tierzero.aio``: ``aio_handle``, a drop-in for DeepSpeed's DeepNVMe
  handle (``AsyncIOBuilder().load().aio_handle``), with no libaio build.
- ``tierzero.deepspeed.install()``: make DeepSpeed's own swap code use it.

Tensors cross into the native module through DLPack: nothing here links
libtorch, and ``torch`` is imported only by the parts that need it.
"""

from ._native import __version__, AioError

__all__ = ["__version__", "AioError", "aio"]


def __getattr__(name):
    if name in ("aio", "deepspeed"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

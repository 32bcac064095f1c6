"""The second entry point, beside :func:`leancompile.optimize`: :func:`wrap` puts the reuse engine around a module
called from a training loop leancompile did not write.

* :mod:`.wrap`: ``wrap`` and ``unwrap``, the arguments checked once;
* :mod:`.wrapped`: the class put in front of the module's own, whose calls go to its runtime;
* :mod:`.wrap_runtime`: that runtime: the engine built from the request, the structure read at each call, the
  frameworks refused or passed through (DDP), the descent to a submodule, auto's measurement, a failure's fallback;
* :mod:`.watch`: the look back at each optimizer step, and the warning where a loop gains nothing.
"""
from .watch import NothingServedError, NothingServedWarning
from .wrap import unwrap, wrap
from .wrapped import Wrapped

__all__ = ["NothingServedError", "NothingServedWarning", "Wrapped", "unwrap", "wrap"]

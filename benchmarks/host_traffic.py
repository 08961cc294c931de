"""Count what a piece of code asks of the host: syncs with the device and bytes copied on the host.

``with HostTraffic() as t: ...`` patches, for the duration of the block only, every way Python code
reaches MLX results or hands data to MLX, and counts:

* ``syncs``: calls that make the host wait for the device's values: ``mx.eval``, ``mx.async_eval``
  (counted although it returns early: it still cuts the graph where the host says), ``array.item()``,
  ``.tolist()``, ``int()/float()/bool()/index()`` of an array, and numpy conversions of an MLX array
  through ``np.array`` / ``np.asarray`` / ``np.asanyarray`` / ``np.ascontiguousarray`` /
  ``np.frombuffer`` / ``np.copy`` (numpy reads MLX arrays through the buffer protocol, which has no
  Python hook: the numpy entry points are patched instead, so a conversion spelled otherwise, e.g.
  ``memoryview(a)``, escapes; ds4_mlx spells them with these functions). Converting the array the
  last ``mx.eval`` just evaluated counts its bytes but not a second sync: that is how
  ``ds4_mlx.model.host.to_host`` reads (evaluate, then copy), and the host waits once;
* ``to_host_bytes``: bytes of the arrays those reads copy to the host;
* ``to_device_bytes``: bytes handed to MLX by ``mx.array(...)`` from host data (numpy arrays,
  Python lists), i.e. host->MLX copies; ``mx.array`` of an MLX array copies nothing and is not counted.

``host_bytes`` = to_host_bytes + to_device_bytes. ``by_site`` counts the same events, and every
``mx.array(...)`` construction (of MLX data too), by (basename of the calling source file, kind),
to say which file of the package does the host work. The patch replaces ``mx.array`` by a class that
constructs real MLX arrays and answers ``isinstance`` for them; it is a benchmark and test helper
and never installed by the package.
"""

from __future__ import annotations

import collections
import os
import sys

import mlx.core as mx
import numpy as np

_REAL_ARRAY = mx.array
_NP_CONVERSIONS = ("array", "asarray", "asanyarray", "ascontiguousarray", "frombuffer", "copy")
_ARRAY_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


def _host_nbytes(data) -> int:
    if isinstance(data, _REAL_ARRAY):
        return 0
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    try:
        return int(np.asarray(data).nbytes)
    except Exception:  # noqa: BLE001 - something MLX accepts that numpy does not: count nothing
        return 0


class HostTraffic:
    """Counters of host syncs and host bytes while installed (see the module docstring)."""

    _active = False

    def __init__(self):
        self.syncs = 0
        self.to_host_bytes = 0
        self.to_device_bytes = 0
        self.by_kind: dict[str, int] = {}
        self.by_site: collections.Counter[tuple[str, str]] = collections.Counter()
        self._saved: list[tuple[object, str, object]] = []
        self._just_evaluated: set[int] = set()

    @property
    def host_bytes(self) -> int:
        return self.to_host_bytes + self.to_device_bytes

    def _sync(self, kind: str, nbytes: int = 0) -> None:
        self._just_evaluated = set()
        self.syncs += 1
        self.to_host_bytes += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self._site(kind)

    def _site(self, kind: str) -> None:
        frame = sys._getframe(1)
        while frame.f_code.co_filename == __file__:  # out of this module's wrappers, to their caller
            frame = frame.f_back
        self.by_site[(os.path.basename(frame.f_code.co_filename), kind)] += 1

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "HostTraffic":
        if HostTraffic._active:
            raise RuntimeError("HostTraffic is already installed")
        HostTraffic._active = True
        counter = self

        def wrap_eval(name, fn):
            def counted(*args, **kwargs):
                counter._sync(name)
                # ``ds4_mlx.model.host.to_host`` evaluates, then converts: one wait, not two
                counter._just_evaluated = {id(a) for a in args if isinstance(a, _REAL_ARRAY)}
                return fn(*args, **kwargs)
            return counted

        self._patch(mx, "eval", wrap_eval("mx.eval", mx.eval))
        self._patch(mx, "async_eval", wrap_eval("mx.async_eval", mx.async_eval))

        for name in _ARRAY_READS:
            fn = getattr(_REAL_ARRAY, name)

            def read(a, *args, _fn=fn, _name=name, **kwargs):
                counter._sync(f"array.{_name}", int(a.nbytes))
                return _fn(a, *args, **kwargs)

            self._patch(_REAL_ARRAY, name, read)

        for name in _NP_CONVERSIONS:
            fn = getattr(np, name)

            def convert(obj, *args, _fn=fn, _name=name, **kwargs):
                if isinstance(obj, _REAL_ARRAY):
                    if id(obj) in counter._just_evaluated:  # the copy after its own mx.eval
                        counter._just_evaluated = set()
                        counter.to_host_bytes += int(obj.nbytes)
                        counter._site(f"np.{_name}")
                    else:
                        counter._sync(f"np.{_name}", int(obj.nbytes))
                return _fn(obj, *args, **kwargs)

            self._patch(np, name, convert)

        class _Meta(type):
            def __instancecheck__(cls, obj):
                return isinstance(obj, _REAL_ARRAY)

            def __getattr__(cls, name):
                return getattr(_REAL_ARRAY, name)

        class CountingArray(metaclass=_Meta):
            def __new__(cls, data, *args, **kwargs):
                counter.to_device_bytes += _host_nbytes(data)
                counter._site("mx.array")
                return _REAL_ARRAY(data, *args, **kwargs)

        self._patch(mx, "array", CountingArray)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        HostTraffic._active = False

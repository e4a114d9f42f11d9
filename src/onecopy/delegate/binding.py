"""Surfaces bound to a delegate: the engine reads and writes them in place, and every copy is counted.

A binding matches by address: when an input's or output's data pointer equals a bound surface's base address,
the argument belongs to the surface (it is locked around the call, and a closed surface fails the call). The
engine reads or writes it in place, through a buffer imported from the surface's memory
(`import_host_allocation`), only when the argument is the surface's bytes in the engine's layout: C-contiguous and
covering the whole surface (`in_place`). Anything else at that address (a transposed view, a slice, a padded
surface: IREE buffer views are dense) is copied through its strides, and the copy is counted like any other; the
address alone never decides, or a transposed view would be read as if it were not.

Thread-safety: a `SurfaceBinding` may be used by concurrent calls; its one cached buffer view is replaced under
a lock when the argument's shape changes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from onecopy.errors import ExecutionError, InvalidArgument

__all__ = ["SurfaceBinding"]


class SurfaceBinding:
    """One surface bound to one delegate: its base address and a buffer view imported from its memory."""

    def __init__(self, surface: Any, where: str):
        from onecopy.surface import Surface

        if not isinstance(surface, Surface):
            raise InvalidArgument(f"{where}: bind_surface takes an onecopy.Surface, got {type(surface).__name__}.")
        if surface.is_closed:
            raise InvalidArgument(f"{where}: surface '{surface.name}' is closed; open it again before binding it.")
        try:
            self.base_address = surface.base_address
            # Only page-aligned memory is ever imported: IREE's AVX-512 code may assume 32-byte aligned buffers
            # (seen here: an imported numpy array 16 bytes off a 32-byte boundary crashed the engine).
            if self.base_address % 4096:
                raise InvalidArgument(f"surface data at {self.base_address:#x} is not page-aligned")
            # A reader's lock proves the surface can be locked now (no writer holds it for good); a bound surface
            # is locked around every call that uses it.
            with surface.lock(readonly=True, blocking=False):
                pass
        except Exception as e:
            raise InvalidArgument(f"{where}: surface '{surface.name}' cannot be bound: {e}") from e
        self.surface = surface
        self.where = where
        self.dense = surface.dense
        self.nbytes = surface.height * surface.width * surface.dtype.itemsize
        # Hold a view: it keeps the mapping alive for the engine even if the surface is closed meanwhile.
        self._array = surface.array(include_padding=True) if self.dense else surface.array()
        self.handed_to_engine = [self._array]  # imported by IREE; held past the delegate's end (quarantine.py)
        self._lock = threading.Lock()  # serializes remakes; readers take `_cached` without it
        self._cached: tuple[tuple, Any] | None = None
        self.views_made = 0

    def check_open(self, what: str) -> None:
        if self.surface.is_closed:
            raise ExecutionError(
                f"{self.where}: {what} is bound surface '{self.surface.name}', which was closed; pass an open "
                f"surface's memory instead: open it again with Surface.open('{self.surface.name}') (or create a new "
                "one), bind that with bind_surface() and pass its array() (a prepared call: prepare it again on "
                "those), or pass a plain array, which is copied."
            )

    def in_place(self, array: np.ndarray) -> bool:
        """Whether the engine may take `array` (at this surface's base address) as the surface's memory itself: its
        elements in C order, densely, over exactly the surface's bytes. Strides are compared, not only the address:
        `surface.array().T` starts at the same byte but reads the elements in another order."""
        return (self.dense and array.flags.c_contiguous and array.nbytes == self.nbytes
                and array.dtype == self.surface.dtype)

    def buffer_view(self, device: Any, shape: tuple[int, ...], dtype: np.dtype, what: str) -> Any:
        """The engine's view of this surface as an argument of `shape`/`dtype`, made once per shape."""
        self.check_open(what)
        cached = self._cached  # (key, view), swapped whole, so a concurrent remake is never seen half-done
        if cached is not None and cached[0] == (shape, dtype):
            return cached[1]
        return self._remake(device, shape, dtype, what)

    def _remake(self, device: Any, shape: tuple[int, ...], dtype: np.dtype, what: str) -> Any:
        import iree.runtime as ireert

        surface = self.surface
        if dtype != surface.dtype:
            raise ExecutionError(
                f"{self.where}: {what} is bound surface '{surface.name}' of dtype {surface.dtype}, but the function "
                f"takes {dtype}; export the method with {surface.dtype} for this argument."
            )
        elements = int(np.prod(shape, dtype=np.int64))
        if elements != surface.height * surface.width:
            raise ExecutionError(
                f"{self.where}: {what} has shape {list(shape)} ({elements} elements) but bound surface "
                f"'{surface.name}' holds {surface.height} x {surface.width}; give the function a compatible shape."
            )
        key = (tuple(shape), dtype)
        with self._lock:
            cached = self._cached
            if cached is None or cached[0] != key:
                element_type = ireert.array_interop.map_dtype_to_element_type(dtype)
                buffer = device.allocator.import_host_allocation(
                    self._array,
                    memory_type=ireert.MemoryType.HOST_LOCAL | ireert.MemoryType.DEVICE_VISIBLE,
                    allowed_usage=ireert.BufferUsage.DEFAULT | ireert.BufferUsage.MAPPING,
                )
                # The constructor, not HalBuffer.create_view: the latter computes a wrong size for fp16.
                cached = (key, ireert.HalBufferView(buffer, list(shape), element_type))
                self._cached = cached
                self.views_made += 1
            return cached[1]

"""Writing one safetensors file a tensor at a time, so memory holds one tensor, not a model.

The format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. Every shape is known
before any tensor is computed (from the metadata of the file being converted),
so the header goes first and each tensor's bytes follow as soon as it exists.
The ``safetensors`` package reads the result like any other file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from types import TracebackType

import torch

_DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_HEADER_ALIGN_BYTES = 8  # tensor data starts 8-byte aligned, as the reference writer does


class SafetensorsWriter:
    """Tensors must be written in the order ``layout`` lists them, each of its shape."""

    def __init__(
        self, path: Path, layout: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
    ) -> None:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"cannot write {dtype} tensors")
        self.dtype = dtype
        self._layout = layout
        self._next = 0
        element_bytes = torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset_bytes = 0
        for name, shape in layout:
            size_bytes = math.prod(shape) * element_bytes
            header[name] = {
                "dtype": _DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset_bytes, offset_bytes + size_bytes],
            }
            offset_bytes += size_bytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % _HEADER_ALIGN_BYTES)
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._layout):
            raise ValueError(f"{name}: every tensor of the layout is already written")
        want_name, want_shape = self._layout[self._next]
        if name != want_name or tuple(tensor.shape) != want_shape:
            raise ValueError(
                f"expected {want_name} {list(want_shape)}, got {name} {list(tensor.shape)}"
            )
        data = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
        # Raw bytes in the machine's order; safetensors is little-endian, as are the
        # machines torch runs on.
        self._file.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        """Flush to disk; fails if a tensor of the layout was never written."""
        try:
            if self._next != len(self._layout):
                missing = [name for name, _ in self._layout[self._next :]]
                raise ValueError(f"tensors never written: {missing[:4]}")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()

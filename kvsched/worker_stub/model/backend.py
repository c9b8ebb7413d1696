"""The handful of array ops the reference model needs, on numpy or on Paddle.

Arrays are opaque to the model: it builds index arrays and masks in numpy, hands them over with
`asarray` / `asindex`, and reads results back with `to_numpy` / `argmax`. Elementwise `+`, `*`
and basic slicing (`x[a:b]`) are used directly; numpy arrays and Paddle tensors both support them.

Paddle is imported only inside `PaddleBackend`, so the daemon, which never builds one, never
imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

Array = Any  # a numpy.ndarray or a paddle.Tensor, depending on the backend


class Backend(ABC):
    """Array ops on one device, in one floating dtype (`float64` by default; see ModelConfig)."""

    name: str

    def __init__(self, dtype: str = "float64") -> None:
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.dtype = dtype

    @abstractmethod
    def asarray(self, x: np.ndarray) -> Array:
        """A floating array of this backend's dtype holding a copy of `x`."""

    @abstractmethod
    def asindex(self, x: np.ndarray | Sequence[int]) -> Array:
        """An int64 index array for `gather` / `scatter_`."""

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray: ...

    @abstractmethod
    def zeros(self, shape: Sequence[int]) -> Array: ...

    @abstractmethod
    def matmul(self, a: Array, b: Array) -> Array:
        """Batched matrix product over the last two axes."""

    @abstractmethod
    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis."""

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """x / rms(x) * weight, over the last axis."""

    @abstractmethod
    def silu(self, x: Array) -> Array: ...

    @abstractmethod
    def concat(self, xs: Sequence[Array], axis: int) -> Array: ...

    @abstractmethod
    def transpose(self, x: Array, perm: Sequence[int]) -> Array: ...

    @abstractmethod
    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...

    @abstractmethod
    def gather(self, table: Array, index: Array) -> Array:
        """Rows `table[index]` of a table indexed along its first axis."""

    @abstractmethod
    def scatter_(self, table: Array, index: Array, rows: Array) -> None:
        """In place: `table[index] = rows` along the first axis."""

    @abstractmethod
    def argmax(self, x: Array) -> np.ndarray:
        """Index of the largest value over the last axis, as a numpy int array (syncs)."""

    def rope(self, x: Array, cos: Array, sin: Array) -> Array:
        """Rotary embedding, rotate-half layout: x [T, H, D], cos/sin [T, 1, D/2]."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class NumpyBackend(Backend):
    name = "numpy"

    def asarray(self, x: np.ndarray) -> Array:
        return np.array(x, dtype=self.dtype)

    def asindex(self, x: np.ndarray | Sequence[int]) -> Array:
        return np.asarray(x, dtype=np.int64)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)

    def zeros(self, shape: Sequence[int]) -> Array:
        return np.zeros(tuple(shape), dtype=self.dtype)

    def matmul(self, a: Array, b: Array) -> Array:
        return np.matmul(a, b)

    def softmax(self, x: Array) -> Array:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    def silu(self, x: Array) -> Array:
        return x / (1.0 + np.exp(-x))

    def concat(self, xs: Sequence[Array], axis: int) -> Array:
        return np.concatenate(list(xs), axis=axis)

    def transpose(self, x: Array, perm: Sequence[int]) -> Array:
        return np.transpose(x, tuple(perm))

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return np.reshape(x, tuple(shape))

    def gather(self, table: Array, index: Array) -> Array:
        return table[index]

    def scatter_(self, table: Array, index: Array, rows: Array) -> None:
        table[index] = rows

    def argmax(self, x: Array) -> np.ndarray:
        return np.asarray(np.argmax(x, axis=-1))


class PaddleBackend(Backend):
    """Paddle on its default device: the GPU with paddlepaddle-gpu, else the CPU."""

    name = "paddle"

    def __init__(self, dtype: str = "float64") -> None:
        super().__init__(dtype)
        import paddle  # lazy: only a worker that asks for this backend pays for (and needs) it

        self._paddle: Any = paddle  # untyped use: paddle's stubs reject plain dtype strings
        self._functional: Any = paddle.nn.functional

    def asarray(self, x: np.ndarray) -> Array:
        return self._paddle.to_tensor(np.asarray(x, dtype=self.dtype))

    def asindex(self, x: np.ndarray | Sequence[int]) -> Array:
        return self._paddle.to_tensor(np.asarray(x, dtype=np.int64))

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x.numpy())

    def zeros(self, shape: Sequence[int]) -> Array:
        return self._paddle.zeros(list(shape), dtype=self.dtype)

    def matmul(self, a: Array, b: Array) -> Array:
        return self._paddle.matmul(a, b)

    def softmax(self, x: Array) -> Array:
        return self._functional.softmax(x, axis=-1)

    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        return x * self._paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps) * weight

    def silu(self, x: Array) -> Array:
        return self._functional.silu(x)

    def concat(self, xs: Sequence[Array], axis: int) -> Array:
        return self._paddle.concat(list(xs), axis=axis)

    def transpose(self, x: Array, perm: Sequence[int]) -> Array:
        return self._paddle.transpose(x, list(perm))

    def reshape(self, x: Array, shape: Sequence[int]) -> Array:
        return self._paddle.reshape(x, list(shape))

    def gather(self, table: Array, index: Array) -> Array:
        return self._paddle.gather(table, index, axis=0)

    def scatter_(self, table: Array, index: Array, rows: Array) -> None:
        self._paddle.scatter_(table, index, rows, overwrite=True)

    def argmax(self, x: Array) -> np.ndarray:
        return np.asarray(self._paddle.argmax(x, axis=-1).numpy())


@lru_cache(maxsize=1)
def paddle_import_error() -> str | None:
    """None when `import paddle` works here, else why not. Imports Paddle: call it only where
    a Paddle backend is wanted (tests, `--backend auto`), never in the daemon."""
    try:
        import paddle  # noqa: F401
    except Exception as exc:  # a broken GPU wheel raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def get_backend(name: str = "numpy", dtype: str = "float64") -> Backend:
    """`numpy`, `paddle`, or `auto` (Paddle when installed, else numpy)."""
    if name == "auto":
        name = "numpy" if paddle_import_error() else "paddle"
    if name == "numpy":
        return NumpyBackend(dtype)
    if name == "paddle":
        return PaddleBackend(dtype)
    raise ValueError(f"backend must be 'numpy', 'paddle' or 'auto', got {name!r}")

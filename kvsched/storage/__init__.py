"""The shared storage tier's client side (DESIGN.md section 14, protocol step 13): a Mooncake
Store client (`client.py`) and a local store for tests and the demo (`server.py`, `kvsched
mooncake`). Imports nothing of Mooncake until a store is connected or started."""

from kvsched.storage.client import (
    KeyMissing,
    MooncakeStore,
    StorageError,
    StoreAddress,
    StoreUnavailable,
    mooncake_available,
    parse_url,
)

__all__ = [
    "KeyMissing",
    "MooncakeStore",
    "StorageError",
    "StoreAddress",
    "StoreUnavailable",
    "mooncake_available",
    "parse_url",
]

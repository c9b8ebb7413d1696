"""The `model` executor: a small seeded transformer on a paged KV cache, and its unpaged reference.

Importing this package imports numpy only; Paddle is imported when a Paddle backend is built.
"""

from kvsched.worker_stub.model.backend import Backend, get_backend, paddle_import_error
from kvsched.worker_stub.model.paged import PagedModelExecutor
from kvsched.worker_stub.model.reference import generate_reference
from kvsched.worker_stub.model.transformer import ModelConfig, Transformer, accept_greedy

__all__ = [
    "Backend",
    "ModelConfig",
    "PagedModelExecutor",
    "Transformer",
    "accept_greedy",
    "generate_reference",
    "get_backend",
    "paddle_import_error",
]

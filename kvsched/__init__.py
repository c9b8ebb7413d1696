"""kvsched: a control-plane daemon for LLM inference (request queue, paged KV cache, step scheduling)."""

__version__ = "0.1.0"

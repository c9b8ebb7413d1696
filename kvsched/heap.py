"""The garbage collector of a long-running kvsched process (daemon, HTTP front end, worker).

What a process builds to start (its modules, the gRPC and HTTP stacks, a tokenizer, vLLM's
model and compiled graphs) lives as long as the process. Once it serves, `freeze_after_start`
moves all of it into the collector's permanent generation, as vLLM's engine and server do
(`gc.freeze`): a full collection while serving then walks only what serving allocated, instead
of the whole start-up heap (measured with gc callbacks over a worker's life, start-up
included: full collections of up to ~0.5 s in the worker, ~0.25 s in the front end; those
during one c=16 benchmark window took 1-20 ms; not measured again after the freeze).
"""

from __future__ import annotations

import gc


def freeze_after_start() -> int:
    """Collect once, then freeze every object alive now; how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

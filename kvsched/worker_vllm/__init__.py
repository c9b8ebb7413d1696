"""vLLM v1's model runner as a kvsched worker (`kvsched worker --executor vllm --model DIR`).

Needs the `vllm` extra; the daemon never imports this package (tests/test_layout.py checks).
Nothing here imports vLLM at import time: vLLM loads when an engine is built.

    cli.py     the engine built from `kvsched worker` arguments; the facts its Hello announces
    engine.py  VllmEngine (the reference WorkerEngine + placement / release hooks), the
               sampling parameters as vLLM's input processor makes them, the engine factory
    runner.py  VllmModel (vLLM's executor, KV cache sized by vLLM) and VllmExecutor (each
               step's SeqWorks as one vLLM SchedulerOutput)
    host.py    the host KV tier's copies, run inside vLLM's worker process
    kv_transfer.py  KV blocks as bytes (prefill/decode hand-off, storage tier), read and
               written inside vLLM's worker process
    spec_decode.py  the worker engine's drafts on vLLM's spec-decode path
"""

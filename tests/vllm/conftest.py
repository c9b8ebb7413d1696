"""The vLLM tests start their workers in eager mode (KVSCHED_VLLM_COMPILE=0: seconds to start
instead of a minute or more on 2 cores), unless the environment says otherwise; the worker's
default, compiled, is covered by tests/vllm/test_http_greedy.py, which asks for it."""

import os

os.environ.setdefault("KVSCHED_VLLM_COMPILE", "0")

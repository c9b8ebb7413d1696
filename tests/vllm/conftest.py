"""The vLLM tests start their workers in eager mode (KVSCHED_VLLM_COMPILE=0: seconds to start
instead of a minute or more on 2 cores), unless the environment says otherwise; the worker's
default, compiled, is covered by tests/vllm/test_http_greedy.py, which asks for it. Set only
where vLLM is installed (the main suite collects this folder too, and skips it)."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is not None:
    os.environ.setdefault("KVSCHED_VLLM_COMPILE", "0")

"""Building vLLM's executor as its EngineCore does: the engine mode (compiled or eager), the
executor and its KV cache sized by vLLM's own profiling (or a fixed block count), the warm-up,
and the EOS id vLLM's input processor would take from the tokenizer. `runner.VllmModel` calls
these once at start."""

from __future__ import annotations

import logging
import os
from typing import Any

from kvsched.worker_vllm import env

log = logging.getLogger(__name__)

# The model runs compiled, as vLLM's own server runs it (inductor on CPU, CUDA graphs on GPU).
# KVSCHED_VLLM_COMPILE=0: eager (starts in seconds, not a minute or more on 2 cores: tests use
# it); vLLM caches compiled graphs (~/.cache/vllm/torch_compile_cache) for later starts.
COMPILE_ENV = "KVSCHED_VLLM_COMPILE"


def compiled() -> bool:
    """Whether the worker lets vLLM compile the model (COMPILE_ENV: "1", the default, or "0")."""
    return env.switch(COMPILE_ENV, True, "compile the model", "eager")


def build_executor(config: Any) -> Any:
    """The executor and its KV cache, as EngineCore's __init__ / _initialize_kv_caches do."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.executor import Executor

    executor = Executor.get_class(config)(config)
    try:
        register_all_kvcache_specs(config)
        specs = executor.get_kv_cache_specs()
        layout = resolve_kv_cache_layout(
            config,
            executor.get_supported_kv_cache_layouts(),
            [s for worker_specs in specs for s in worker_specs.values()],
        )
        executor.set_kv_cache_layout(layout.name)
        available = executor.determine_available_memory()
        before = config.model_config.max_model_len
        kv_configs = get_kv_cache_configs(config, specs, available)
        for kv_config in kv_configs:
            kv_config.kv_cache_layout = config.cache_config.kv_cache_layout
        if config.model_config.max_model_len != before:
            executor.collective_rpc(
                "update_max_model_len", args=(config.model_config.max_model_len,)
            )
        sched_config = generate_scheduler_kv_cache_config(kv_configs)
        config.cache_config.num_gpu_blocks = sched_config.num_blocks
        groups = sched_config.kv_cache_groups
        if len(groups) != 1:
            raise RuntimeError(
                f"the model has {len(groups)} KV cache groups: this worker drives models with "
                "one full-attention group (no sliding window / hybrid / mamba layers)"
            )
        config.cache_config.block_size = groups[0].kv_cache_spec.block_size
        update_kv_cache_capacity(config, sched_config)
        config.validate_block_size()
        block, hash_block = resolve_kv_cache_block_sizes(sched_config, config)
        align = resolve_cache_hit_alignment_tokens(sched_config, config, block, hash_block)
        for kv_config in (*kv_configs, sched_config):
            kv_config.hash_block_size = hash_block
            kv_config.cache_hit_alignment_tokens = align
        executor.initialize_from_config(kv_configs)
        executor.compile_or_warm_up_model()
    except BaseException:
        executor.shutdown()
        raise
    return executor


def tokenizer_eos(model: str) -> int | None:
    """The EOS id vLLM's input processor would take from the model's tokenizer (None when the
    directory has no tokenizer files: then only generation_config.json names EOS ids)."""
    if not any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    try:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(model).eos_token_id
    except Exception:  # a tokenizer vLLM could not load either: it would fail to serve text
        log.warning("could not load the tokenizer of %s for its EOS id", model, exc_info=True)
        return None
    return int(eos) if eos is not None else None

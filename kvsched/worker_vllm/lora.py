"""LoRA adapters under vLLM's runner, as vLLM's engine runs them: the engine is built with LoRA
enabled (`enable_lora`, `max_loras`, `max_cpu_loras`, `max_lora_rank`: its CPU punica wrapper on
CPU), each adapter the worker announced gets one `LoRARequest` (a stable integer id from 1,
its name and path, as vLLM's server makes them for `--lora-modules`), and every request of an
adapter carries it in its `NewRequestData.lora_request` (its prompt's non-final chunks under
the alias id too: their KV is the adapter's).

Loading is vLLM's own: per step the runner activates the adapters of the requests scheduled
(`set_active_loras`), and its `LRUCacheWorkerLoRAManager` loads an adapter from its path on
first use into host memory (at most max_cpu_loras kept, least recently used evicted) and into
one of max_loras GPU slots. It raises when one step needs more than max_loras adapters: the
daemon never places requests of more (`scheduler.max_loras` from the Hello), and the worker
engine counts every step's distinct adapters (WorkerStats.lora_steps).
"""

from __future__ import annotations

from typing import Any

from kvsched.worker_stub.lora import LoraSlots


def engine_args(slots: LoraSlots) -> dict[str, Any]:
    """EngineArgs fields that enable LoRA for `slots` (none without adapters)."""
    if not slots.adapters:
        return {}
    return {
        "enable_lora": True,
        "max_loras": slots.max_loras,
        "max_cpu_loras": slots.max_cpu_loras or slots.max_loras,
        "max_lora_rank": slots.max_lora_rank,
    }


def lora_requests(slots: LoraSlots) -> dict[str, Any]:
    """Adapter name -> vLLM's LoRARequest (ids 1, 2, ... in the order announced)."""
    if not slots.adapters:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        name: LoRARequest(lora_name=name, lora_int_id=i, lora_path=path)
        for i, (name, path) in enumerate(slots.adapters, start=1)
    }


def mask_base_rows(_worker: Any = None) -> int:
    """Fix vLLM 0.32's CPU LoRA kernels for tokens without an adapter (run in vLLM's worker
    child through `collective_rpc`; returns how many functions were patched).

    The CPU punica wrapper's torch ops select each token's adapter weights with
    `weights[lora_indices]`, and a token without an adapter has index -1: it gets the LAST
    adapter slot's weights. In a step that mixes base-model requests with max_loras adapters
    (the last slot filled), the base requests run with that adapter: measured on the tiny model,
    vLLM's own `LLM.generate` with LoRA enabled gives other greedy texts for base requests
    batched with adapter requests than for the same requests alone (or without LoRA). Every
    LoRA path first shrinks into a buffer (`bgmv_shrink`, also through `sgmv_shrink`) and then
    expands that buffer, so zeroing the shrink's rows of index -1 makes their LoRA term zero."""
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as cpu

    original = getattr(ops.bgmv_shrink, "kvsched_original", ops.bgmv_shrink)

    def bgmv_shrink(
        inputs: Any, weights: Any, output: Any, indices: Any, scaling: float = 1.0
    ) -> None:
        original(inputs, weights, output, indices, scaling)
        base = indices < 0
        if bool(base.any()):
            output[: base.shape[0]][base] = 0

    bgmv_shrink.kvsched_original = original  # type: ignore[attr-defined]
    ops.bgmv_shrink = bgmv_shrink  # sgmv_shrink calls it through the module
    cpu.bgmv_shrink = bgmv_shrink  # (bound by name at import)
    return 2

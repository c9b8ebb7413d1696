"""`kvsched worker --executor vllm`: the engine built from the command line's arguments."""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass

from kvsched.worker_stub.factories import EngineFactory
from kvsched.worker_stub.lora import LoraSlots


@dataclass(frozen=True, slots=True)
class AnnouncedFacts:
    """What the worker's Hello says of the engine."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    model_name: str
    structured_outputs: bool  # a tokenizer to compile grammars against
    max_logprobs: int = 0


def vllm_factory_from_args(
    args: argparse.Namespace, lora: LoraSlots | None = None
) -> tuple[EngineFactory, AnnouncedFacts]:
    """Load the model into vLLM's executor now (tens of seconds on CPU): its facts go into the
    Hello; with `lora`'s adapters, LoRA enabled (each adapter's path must be a directory: vLLM
    loads it on first use). ValueError naming the flag on bad arguments."""
    model = getattr(args, "model", "")
    if not model:
        raise ValueError("--executor vllm needs --model DIR (a model directory)")
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is not a directory")
    spec_k = getattr(args, "num_speculative_tokens", 0)
    for flag, value in [
        ("--num-blocks", args.num_blocks),
        ("--block-size", args.block_size),
        ("--num-speculative-tokens", spec_k),
    ]:
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    draft_model = getattr(args, "draft_model", "")
    if draft_model and not spec_k:
        raise ValueError("--draft-model needs --num-speculative-tokens K > 0 (drafts per step)")
    if draft_model and not os.path.isdir(draft_model):
        raise ValueError(f"--draft-model {draft_model!r} is not a directory")
    lora = lora or LoraSlots()
    for name, path in lora.adapters:
        if not os.path.isdir(path):
            raise ValueError(f"--lora-modules {name}={path}: {path!r} is not a directory")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--executor vllm needs vLLM: pip install 'kvsched[vllm]'")
    from kvsched.worker_vllm.engine import vllm_engine_factory
    from kvsched.worker_vllm.runner import VllmModel

    engine = VllmModel(
        model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=getattr(args, "max_model_len", 0),
        num_blocks=args.num_blocks,
        max_num_seqs=args.num_slots,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        num_host_blocks=getattr(args, "host_blocks", 0),
        num_speculative_tokens=spec_k,
        lora=lora,
        draft_model=draft_model,
    )
    f = engine.facts
    name = os.path.basename(os.path.normpath(model))
    facts = AnnouncedFacts(
        f.num_blocks,
        f.block_size,
        f.max_model_len,
        f.vocab_size,
        name,
        f.eos_token_id is not None,
        f.max_logprobs,
    )
    return vllm_engine_factory(engine, args.num_slots), facts

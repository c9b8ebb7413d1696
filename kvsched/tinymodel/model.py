"""A random-weight Llama written offline with `transformers` (needs torch: the `vllm` extra):
config.json, model.safetensors and generation_config.json, enough for vLLM to load and run.

    make_model("/tmp/tiny")                  # ~1 s; vocab 512, 2 layers, hidden 128, float32

Token ids follow the tiny tokenizer (tokenizer.py): unk 0, bos 1, eos 2. The weights are drawn
from `seed` with a wider than usual spread, so greedy decoding varies with the prompt and ties
between the two best logits are rare (the proof test compares tokens with vLLM's own generate).
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


def make_model(
    directory: str | Path,
    vocab_size: int = 512,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    seed: int = 0,
) -> Path:
    """Write the model into `directory` (created); returns it. Deterministic for a seed."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"need hidden % heads == 0 and heads % kv_heads == 0, got {hidden}/{heads}/{kv_heads}"
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(out)
    # transformers may write a sampling default into generation_config.json; keep it greedy-neutral
    path = out / "generation_config.json"
    data = json.loads(path.read_text())
    for key in ("temperature", "top_p", "top_k", "do_sample"):
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return out

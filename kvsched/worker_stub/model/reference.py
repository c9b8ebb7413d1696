"""The unpaged reference: the same model on one prompt alone, with a contiguous KV cache.

It shares the weights and the layer math (`Transformer.forward`, `Transformer.attend`) with the
paged executor but none of its KV addressing: here each layer's cache is the concatenation of
every K/V computed so far, in position order, with no blocks, slots or tables.
"""

from __future__ import annotations

import numpy as np

from kvsched.core.protocol import MultimodalRange
from kvsched.worker_stub.model.backend import Array, Backend
from kvsched.worker_stub.model.encoder import encode_item, placeholder_rows
from kvsched.worker_stub.model.transformer import _EMBED_STD, ModelConfig, Transformer


def generate_reference(
    config: ModelConfig,
    prompt_token_ids: list[int],
    max_tokens: int,
    backend: Backend | str = "numpy",
    eos_token_id: int | None = None,
    ignore_eos: bool = True,
    mm_ranges: list[MultimodalRange] | None = None,
) -> list[int]:
    """Greedy continuation of the prompt: up to max_tokens tokens, stopping after EOS unless
    ignore_eos, and stopping when the sequence reaches config.max_model_len. mm_ranges: the
    prompt's multimodal items, encoded afresh here (no cache)."""
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    if len(prompt_token_ids) >= config.max_model_len:
        raise ValueError(f"prompt of {len(prompt_token_ids)} tokens >= max_model_len")
    eos = config.eos_token_id if eos_token_id is None else eos_token_id
    model = Transformer(config, backend)
    b = model.backend
    keys: list[Array | None] = [None] * config.num_layers
    values: list[Array | None] = [None] * config.num_layers
    start = 0

    def attention(layer: int, q: Array, k: Array, v: Array) -> Array:
        prev_k, prev_v = keys[layer], values[layer]
        keys[layer] = k if prev_k is None else b.concat([prev_k, k], axis=0)
        values[layer] = v if prev_v is None else b.concat([prev_v, v], axis=0)
        return model.attend(q, keys[layer], values[layer], start)

    feed = list(prompt_token_ids)
    output: list[int] = []

    def encode(content_hash: str, length: int) -> np.ndarray:
        return encode_item(content_hash, length, config.hidden, config.seed, _EMBED_STD)

    embeds = placeholder_rows([(0, 0, len(feed), mm_ranges or [])], encode)
    while len(output) < max_tokens and start + len(feed) < config.max_model_len:
        positions = np.arange(start, start + len(feed))
        hidden = model.forward(np.asarray(feed, dtype=np.int64), positions, attention, embeds)
        embeds = None  # the prompt only
        token = int(b.argmax(model.logits(hidden[len(feed) - 1 :]))[0])
        output.append(token)
        if token == eos and not ignore_eos:
            break
        start += len(feed)
        feed = [token]
    return output

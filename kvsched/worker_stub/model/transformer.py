"""A small decoder-only transformer whose K/V live only in a paged cache.

The model exists to check the scheduler: every worker process builds the same weights from
`ModelConfig.seed`, decodes greedily, and keeps its K/V nowhere but in the cache blocks the
daemon's block tables name. A block handed to two requests, freed while still read, or a prefix
hit on the wrong tokens changes what attention reads and so, within a few tokens, what the model
emits; `reference.generate_reference` runs the same model unpaged to compare against.

The paged executor over this model is `paged.PagedModelExecutor` (its cache addressing is drawn
there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvsched.worker_stub.model.backend import Array, Backend, get_backend

# Initial weight scales, chosen so greedy decoding neither sticks to one token nor falls into a
# short cycle, and so attention is sharp enough that replacing a block of K/V changes the output.
_QK_STD = 0.5  # q.k logits of std ~ _QK_STD**2 * hidden: sharp, content-dependent attention
_V_STD = 1.0
_OUT_STD = 0.5  # attention and MLP outputs comparable to the unit-scale token embedding
_MLP_IN_STD = 0.9
_MLP_OUT_STD = 0.3
_EMBED_STD = 1.0
_LM_HEAD_STD = 1.0
_RMS_EPS = 1e-6

AttentionFn = Callable[[int, Array, Array, Array], Array]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and seed of the model. Equal configs give equal weights in every process."""

    vocab_size: int = 2048
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    max_model_len: int = 4096
    seed: int = 0
    eos_token_id: int = 1
    rope_theta: float = 10000.0
    # Chunking and batch shape change rounding; in float64 that stays far below any argmax gap.
    dtype: str = "float64"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even and >= 2, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"ModelConfig.eos_token_id must be in [0, {self.vocab_size}), "
                f"got {self.eos_token_id}"
            )
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"ModelConfig.dtype must be float32 or float64, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"ModelConfig.max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim


@lru_cache(maxsize=8)
def _numpy_weights(config: ModelConfig) -> dict[str, np.ndarray]:
    """All weights, drawn in a fixed order from one seeded numpy Generator (then converted by
    the backend), so every process and both backends hold the same model."""
    rng = np.random.default_rng(config.seed)
    d, hd = config.hidden, config.head_dim

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * std

    w = {"embed": normal(config.vocab_size, d, _EMBED_STD), "final_norm": np.ones(d)}
    for i in range(config.num_layers):
        w[f"{i}.attn_norm"] = np.ones(d)
        q_k = normal(d, (config.num_heads + config.num_kv_heads) * hd, _QK_STD)
        v = normal(d, config.num_kv_heads * hd, _V_STD / np.sqrt(d))
        w[f"{i}.wqkv"] = np.concatenate([q_k, v], axis=1)
        w[f"{i}.wo"] = normal(d, d, _OUT_STD / np.sqrt(d))
        w[f"{i}.mlp_norm"] = np.ones(d)
        w[f"{i}.w_gate_up"] = normal(d, 2 * config.ffn, _MLP_IN_STD / np.sqrt(d))
        w[f"{i}.w_down"] = normal(config.ffn, d, _MLP_OUT_STD / np.sqrt(config.ffn))
    w["lm_head"] = normal(d, config.vocab_size, _LM_HEAD_STD / np.sqrt(d))
    return w


@lru_cache(maxsize=8)
def _rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(half) / half)
    angles = np.arange(config.max_model_len)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


class Transformer:
    """The layer math, shared by the paged executor and the unpaged reference.

    `forward` never touches a KV cache: each layer hands its new q, k, v to an `attention`
    callback, which stores k, v wherever its cache lives and returns the attention output.
    """

    def __init__(self, config: ModelConfig, backend: Backend | str = "numpy") -> None:
        self.config = config
        self.backend = get_backend(backend, config.dtype) if isinstance(backend, str) else backend
        b = self.backend
        self.weights = {name: b.asarray(value) for name, value in _numpy_weights(config).items()}
        self._cos, self._sin = _rope_tables(config)
        self._scale = 1.0 / np.sqrt(config.head_dim)

    def forward(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        attention: AttentionFn,
        embeds: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> Array:
        """Hidden states [T, hidden] of a flat batch of tokens at the given positions; embeds
        (rows, embeddings): encoder outputs that replace those rows' token embeddings.

        attention(layer, q [T, heads, hd], k [T, kv_heads, hd], v [T, kv_heads, hd]) -> [T, hidden]
        """
        b, c, w = self.backend, self.config, self.weights
        n, hd = len(token_ids), c.head_dim
        nq, nkv = c.num_heads * hd, c.num_kv_heads * hd
        x = b.gather(w["embed"], b.asindex(token_ids))
        if embeds is not None:  # multimodal placeholders (encoder.py)
            b.scatter_(x, b.asindex(embeds[0]), b.asarray(embeds[1]))
        cos = b.asarray(self._cos[positions][:, None, :])
        sin = b.asarray(self._sin[positions][:, None, :])
        for i in range(c.num_layers):
            qkv = b.matmul(b.rms_norm(x, w[f"{i}.attn_norm"], _RMS_EPS), w[f"{i}.wqkv"])
            q = b.rope(b.reshape(qkv[:, :nq], [n, c.num_heads, hd]), cos, sin)
            k = b.rope(b.reshape(qkv[:, nq : nq + nkv], [n, c.num_kv_heads, hd]), cos, sin)
            v = b.reshape(qkv[:, nq + nkv :], [n, c.num_kv_heads, hd])
            x = x + b.matmul(attention(i, q, k, v), w[f"{i}.wo"])
            gate_up = b.matmul(b.rms_norm(x, w[f"{i}.mlp_norm"], _RMS_EPS), w[f"{i}.w_gate_up"])
            x = x + b.matmul(b.silu(gate_up[:, : c.ffn]) * gate_up[:, c.ffn :], w[f"{i}.w_down"])
        return x

    def logits(self, hidden: Array) -> Array:
        return self.backend.matmul(
            self.backend.rms_norm(hidden, self.weights["final_norm"], _RMS_EPS),
            self.weights["lm_head"],
        )

    def attend(self, q: Array, k: Array, v: Array, start: int) -> Array:
        """Causal GQA attention of queries at positions [start, start + Tq) over keys [0, L).

        q [Tq, heads, hd]; k, v [L, kv_heads, hd] with L = start + Tq. Returns [Tq, hidden].
        """
        b, c = self.backend, self.config
        num_q, num_k, hd = q.shape[0], k.shape[0], c.head_dim
        kvh, group = c.num_kv_heads, c.num_heads // c.num_kv_heads
        # heads h = g_kv * group + j share kv head g_kv: fold the group into the query rows
        qg = b.reshape(
            b.transpose(b.reshape(q, [num_q, kvh, group, hd]), [1, 2, 0, 3]),
            [kvh, group * num_q, hd],
        )
        scores = b.matmul(qg, b.transpose(k, [1, 2, 0])) * self._scale  # [kvh, group*Tq, L]
        if num_q > 1:
            future = np.arange(num_k)[None, :] > start + np.arange(num_q)[:, None]
            mask = b.asarray(np.tile(np.where(future, -np.inf, 0.0), (group, 1)))
            scores = scores + mask
        out = b.matmul(b.softmax(scores), b.transpose(v, [1, 0, 2]))  # [kvh, group*Tq, hd]
        out = b.transpose(b.reshape(out, [kvh, group, num_q, hd]), [2, 0, 1, 3])
        return b.reshape(out, [num_q, c.hidden])


def accept_greedy(token_ids: list[int], num_draft: int, greedy: list[int]) -> list[int]:
    """Speculative verification. greedy[i] is the argmax after token_ids[-1 - num_draft + i].

    Drafts are accepted while each equals the greedy token before it; then one bonus token.
    """
    drafts = token_ids[len(token_ids) - num_draft :]
    accepted: list[int] = []
    for draft in drafts:
        if draft != greedy[len(accepted)]:
            break
        accepted.append(draft)
    return [*accepted, greedy[len(accepted)]]

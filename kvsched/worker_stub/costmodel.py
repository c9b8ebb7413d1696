"""GPU step time of Llama-3-8B (bf16, TP1): fits to Vidur's profiles (kvsched/data/README.md).

    step_ms = max(floor, base + per_token * N) + overhead
              + per_ctx * (sum of context tokens of the decoding sequences)
              + per_attn * sum over prefill chunks of c * (c + prefix)

N = prefill tokens + decoding sequences (+ speculative draft tokens, which ride through the
weights like prefill tokens). H100 constants are scaled from Llama-2-7B, attention +-50 %.
Pure functions: benchmarks use them without a worker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepFit:
    """Constants of one GPU's fit, in milliseconds."""

    floor_ms: float
    base_ms: float
    per_token_ms: float
    overhead_ms: float
    per_ctx_ms: float
    per_attn_ms: float


# KV bytes of one token of the fitted model (Llama-3-8B: 32 layers x 8 KV heads x 128 dims x
# K and V x 2 bytes): what the sim's host-tier copies move over PCIe.
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2

# KV memory of the fitted model on each GPU: an 80 GB card holds Llama-3-8B's 16 GB of weights
# and activations, and 40 GiB of KV (what `kvsched replay --embedded` gives each instance:
# 5,120 blocks of 64 tokens, 8 MiB each). The sim worker's default pool is this many bytes.
KV_POOL_BYTES: dict[str, int] = {"h100": 40 << 30, "a100": 40 << 30}

FITS: dict[str, StepFit] = {
    "h100": StepFit(6.3, 4.3, 0.0211, 0.0, 4.9e-5, 1.8e-6),
    "a100": StepFit(10.5, 5.5, 0.0666, 0.6, 8.0e-5, 4.3e-6),
}


def fit_for(gpu: str) -> StepFit:
    """The fit of `gpu` ("h100" or "a100"); ValueError names the choices otherwise."""
    fit = FITS.get(gpu.lower())
    if fit is None:
        raise ValueError(f"gpu must be one of {sorted(FITS)}, got {gpu!r}")
    return fit


def default_num_blocks(gpu: str, block_size: int) -> int:
    """KV blocks of `block_size` tokens the fitted model has on `gpu` (KV_POOL_BYTES): h100,
    64-token blocks -> 5,120; 16-token blocks -> 20,480."""
    fit_for(gpu)  # validates the name
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return KV_POOL_BYTES[gpu.lower()] // (KV_BYTES_PER_TOKEN * block_size)


def step_time_s(
    gpu: str,
    prefill_chunks: list[tuple[int, int]],
    decode_context_lens: list[int],
    num_draft_tokens: int = 0,
) -> float:
    """Seconds one step takes on `gpu`.

    prefill_chunks: (chunk length c, prefix tokens before it) per prefill chunk.
    decode_context_lens: tokens each decoding sequence attends over (its own position included).
    num_draft_tokens: speculative tokens verified this step, beyond one per decoding sequence.
    An empty step takes 0.
    """
    return step_time_s_of(
        gpu, prefill_chunks, len(decode_context_lens), sum(decode_context_lens), num_draft_tokens
    )


def step_time_s_of(
    gpu: str,
    prefill_chunks: list[tuple[int, int]],
    num_decodes: int,
    sum_decode_context_lens: int,
    num_draft_tokens: int = 0,
) -> float:
    """`step_time_s` from the decodes' count and summed context lengths (all it needs of them)."""
    fit = fit_for(gpu)
    num_tokens = sum(c for c, _ in prefill_chunks) + num_decodes + num_draft_tokens
    if num_tokens == 0:
        return 0.0
    attn = sum(c * (c + prefix) for c, prefix in prefill_chunks)
    ms = (
        max(fit.floor_ms, fit.base_ms + fit.per_token_ms * num_tokens)
        + fit.overhead_ms
        + fit.per_ctx_ms * sum_decode_context_lens
        + fit.per_attn_ms * attn
    )
    return ms / 1000.0

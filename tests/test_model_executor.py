"""The `model` executor against its unpaged reference, with block tables built by hand.

No daemon: each test plays scheduler, hands the executor SeqWork with block tables, and compares
the tokens with `generate_reference`. The corruption tests show the comparison can fail.
"""

from __future__ import annotations

import subprocess
import sys
from functools import cache

import numpy as np
import pytest

from kvsched.core.protocol import SamplingParams
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_stub.model import (
    ModelConfig,
    PagedModelExecutor,
    accept_greedy,
    generate_reference,
    paddle_import_error,
)

# importing paddle warns that ccache (for building C++ extensions) is missing: irrelevant here
pytestmark = pytest.mark.filterwarnings("ignore:No ccache found:UserWarning")

CONFIG = ModelConfig()
BLOCK_SIZE = 8
NUM_BLOCKS = 96


@pytest.fixture(params=["numpy", "paddle"])
def backend(request: pytest.FixtureRequest) -> str:
    skip_unless_importable(str(request.param))
    return str(request.param)


def skip_unless_importable(backend: str) -> None:
    if backend == "paddle" and (error := paddle_import_error()):
        pytest.skip(f"paddle cannot be imported ({error}); install the `paddle` extra to test it")


def make_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, size=length).tolist()


@cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The numpy reference, for every backend: both must produce exactly these tokens."""
    return generate_reference(CONFIG, list(prompt), max_tokens)


def make_executor(backend: str = "numpy", num_blocks: int = NUM_BLOCKS) -> PagedModelExecutor:
    return PagedModelExecutor(CONFIG, num_blocks, BLOCK_SIZE, backend=backend)


def seq_work(
    handle: int,
    blocks: list[int],
    start: int,
    token_ids: list[int],
    sample: bool = True,
    num_draft: int = 0,
) -> SeqWork:
    return SeqWork(
        handle, f"req-{handle}", blocks, start, token_ids, sample, num_draft, SamplingParams()
    )


class Seq:
    """One request as a tiny scheduler sees it: prompt, table, progress, outputs."""

    def __init__(self, handle: int, prompt: list[int], blocks: list[int], start: int = 0) -> None:
        self.handle, self.prompt, self.blocks = handle, prompt, blocks
        self.num_computed = start  # KV present for positions [0, num_computed)
        self.output: list[int] = []

    def next_work(self, chunk: int) -> SeqWork:
        if self.num_computed < len(self.prompt):
            tokens = self.prompt[self.num_computed : self.num_computed + chunk]
            done = self.num_computed + len(tokens) == len(self.prompt)
            return seq_work(self.handle, self.blocks, self.num_computed, tokens, sample=done)
        return seq_work(self.handle, self.blocks, self.num_computed, self.output[-1:])

    def apply(self, work: SeqWork, tokens: list[int]) -> None:
        self.num_computed += len(work.token_ids) - work.num_draft + max(len(tokens) - 1, 0)
        self.output += tokens


def run_steps(ex: PagedModelExecutor, seqs: list[Seq], max_tokens: int, chunks: list[int]) -> None:
    """Step all sequences together until each has max_tokens outputs; chunk sizes cycle."""
    step = 0
    while active := [s for s in seqs if len(s.output) < max_tokens]:
        work = [s.next_work(chunks[(step + s.handle) % len(chunks)]) for s in active]
        result = ex.execute(work)
        assert len(result.tokens) == len(work) and result.step_time_s > 0
        for s, w, tokens in zip(active, work, result.tokens, strict=True):
            s.apply(w, tokens)
        step += 1


def test_prefill_in_one_chunk_then_decode_equals_reference(backend: str) -> None:
    prompt = make_prompt(1, 45)
    seq = Seq(0, prompt, blocks=list(range(10)))
    run_steps(make_executor(backend), [seq], max_tokens=30, chunks=[len(prompt)])
    assert seq.output == reference(tuple(prompt), 30)


def test_chunked_prefill_on_shuffled_tables_equals_reference(backend: str) -> None:
    rng = np.random.default_rng(7)
    free = rng.permutation(NUM_BLOCKS).tolist()
    prompts = [make_prompt(10 + i, n) for i, n in enumerate([61, 100, 9])]
    seqs = []
    for handle, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + 24) // BLOCK_SIZE)
        seqs.append(Seq(handle, prompt, [free.pop() for _ in range(num_blocks)]))
    # prefill chunks of odd sizes interleave with the other sequences' decodes
    run_steps(make_executor(backend), seqs, max_tokens=24, chunks=[7, 13, 1, 29, 5])
    for seq in seqs:
        assert seq.output == reference(tuple(seq.prompt), 24)


def test_prefix_blocks_shared_by_two_sequences_equal_reference(backend: str) -> None:
    shared = make_prompt(20, 5 * BLOCK_SIZE)
    first = Seq(0, shared + make_prompt(21, 11), blocks=list(range(0, 12)))
    ex = make_executor(backend)
    run_steps(ex, [first], max_tokens=1, chunks=[17])
    # the second request hits the first 5 blocks and computes only its own suffix
    second = Seq(1, shared + make_prompt(22, 6), blocks=[0, 1, 2, 3, 4, 40, 41, 42, 43], start=40)
    run_steps(ex, [first, second], max_tokens=20, chunks=[3, 4])
    assert first.output == reference(tuple(first.prompt), 20)
    assert second.output == reference(tuple(second.prompt), 20)


def test_block_shared_by_two_sequences_for_different_tokens_is_detected() -> None:
    a = Seq(0, make_prompt(30, 40), blocks=[0, 1, 2, 3, 4, 5, 6, 7])
    b = Seq(1, make_prompt(31, 40), blocks=[10, 11, 2, 13, 14, 15, 16, 17])  # block 2 twice
    run_steps(make_executor(), [a, b], max_tokens=16, chunks=[12, 9])
    expected = [reference(tuple(s.prompt), 16) for s in (a, b)]
    assert [a.output, b.output] != expected


def test_prefix_hit_on_blocks_never_written_is_detected() -> None:
    prompt = make_prompt(32, 30)
    seq = Seq(0, prompt, blocks=[3, 4, 5, 6, 7, 8], start=2 * BLOCK_SIZE)  # nobody wrote 3, 4
    run_steps(make_executor(), [seq], max_tokens=8, chunks=[32])
    assert seq.output != reference(tuple(prompt), 8)


def test_speculative_drafts_accepted_up_to_first_wrong_token(backend: str) -> None:
    prompt = make_prompt(40, 37)
    expected = reference(tuple(prompt), 40)
    ex = make_executor(backend)
    blocks = list(range(20, 30))
    first = ex.execute([seq_work(0, blocks, 0, prompt)]).tokens[0]
    output, pos = list(first), len(prompt)
    # (num_draft, index of the first wrong draft or None): full accepts, rejects, a lone bonus
    plan = [(4, None), (3, 0), (5, 2), (0, None), (6, None), (2, 1), (4, 3)]
    for num_draft, wrong in plan:
        drafts = list(expected[len(output) : len(output) + num_draft])
        if wrong is not None:
            drafts[wrong] = (drafts[wrong] + 1) % CONFIG.vocab_size
        work = seq_work(0, blocks, pos, [output[-1], *drafts], num_draft=num_draft)
        other = seq_work(1, [50, 51, 52, 53], 0, make_prompt(41, 20))  # batched alongside
        tokens = ex.execute([work, other]).tokens[0]
        num_accepted = num_draft if wrong is None else wrong
        assert tokens == expected[len(output) : len(output) + num_accepted + 1]
        output += tokens
        pos += len(tokens)  # KV of the rejected drafts is stale and is overwritten next step
    assert output == expected[: len(output)]


def test_accept_greedy() -> None:
    assert accept_greedy([5, 6, 7], 2, greedy=[6, 7, 8]) == [6, 7, 8]
    assert accept_greedy([5, 6, 7], 2, greedy=[6, 9, 8]) == [6, 9]
    assert accept_greedy([5, 6, 7], 2, greedy=[1, 7, 8]) == [1]
    assert accept_greedy([5], 0, greedy=[4]) == [4]


@pytest.mark.parametrize("dst_backend", ["numpy", "paddle"])
def test_kv_exported_after_prefill_continues_decoding_elsewhere(
    backend: str, dst_backend: str
) -> None:
    skip_unless_importable(dst_backend)
    prompt = make_prompt(50, 53)
    prefill = make_executor(backend)
    src_blocks = [9, 2, 30, 4, 17, 6, 7]
    first = prefill.execute([seq_work(0, src_blocks, 0, prompt)]).tokens[0]
    decode = make_executor(dst_backend, num_blocks=40)
    dst_blocks = [39, 0, 12, 5, 33, 8, 21, 22, 23]
    decode.import_kv(dst_blocks[: len(src_blocks)], prefill.export_kv(src_blocks))
    seq = Seq(0, prompt, dst_blocks, start=len(prompt))
    seq.output = list(first)
    run_steps(decode, [seq], max_tokens=15, chunks=[1])
    assert seq.output == reference(tuple(prompt), 15)


def test_import_kv_rejects_wrong_size() -> None:
    ex = make_executor()
    data = ex.export_kv([1, 2])
    with pytest.raises(ValueError, match="bytes"):
        ex.import_kv([1, 2, 3], data)


def test_execute_rejects_table_too_short_before_touching_cache() -> None:
    ex = make_executor()
    before = ex.export_kv([0, 1])
    with pytest.raises(ValueError, match="cannot hold"):
        ex.execute(
            [seq_work(0, [0, 1], 0, make_prompt(60, 2 * BLOCK_SIZE)), seq_work(1, [1], 0, [5] * 9)]
        )
    assert ex.export_kv([0, 1]) == before


def test_reset_forgets_the_cache() -> None:
    prompt = make_prompt(61, 20)
    ex = make_executor()
    ex.execute([seq_work(0, [0, 1, 2, 3], 0, prompt)])
    ex.reset()
    tokens = ex.execute([seq_work(0, [0, 1, 2, 3], len(prompt) - 1, prompt[-1:])]).tokens[0]
    assert tokens != reference(tuple(prompt), 1)


def test_greedy_output_is_not_degenerate() -> None:
    """A model that repeats itself would let KV bugs through; this one does not."""
    for seed in range(3):
        output = reference(tuple(make_prompt(70 + seed, 12)), 300)
        assert len(set(output)) > 200
        assert not any(output[i] == output[i - 1] == output[i - 2] for i in range(2, 300))
        tail = output[-60:]
        assert not any(tail[:-p] == tail[p:] for p in range(1, 30)), "ends in a short cycle"


def test_importing_the_model_does_not_import_paddle() -> None:
    code = "import sys, kvsched.worker_stub.model; assert 'paddle' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reference_is_the_same_on_every_backend(backend: str) -> None:
    prompt = make_prompt(80, 33)
    assert generate_reference(CONFIG, prompt, 25, backend=backend) == reference(tuple(prompt), 25)


def test_reference_stops_at_eos_unless_ignored() -> None:
    prompt = make_prompt(81, 10)
    expected = reference(tuple(prompt), 6)
    eos = expected[3]
    stopped = generate_reference(CONFIG, prompt, 6, eos_token_id=eos, ignore_eos=False)
    assert stopped == expected[: expected.index(eos) + 1]

"""The worker's side of the encoder cache: the engine refuses an `encoder_drops` that names an
item a queued chunk still reads, applies the others (after preempts and aborts), and the model
executor reads cached encoder outputs at placeholder positions, encoding each item once."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.errors import ProtocolError
from kvsched.core.protocol import MultimodalRange, Tasks
from kvsched.worker_stub.engine import WorkerEngine
from kvsched.worker_stub.executor import SeqWork
from kvsched.worker_stub.model import ModelConfig, PagedModelExecutor
from kvsched.worker_stub.model.encoder import EncoderOutputs
from tests.test_worker_engine import BLOCK, EOS, Recording, place, prompt_chunk


class Dropping(Recording):
    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[list[str]] = []

    def drop_encoder_items(self, hashes: list[str]) -> None:
        self.dropped.append(list(hashes))


def with_item(handle: int, item: str, prompt_len: int = 14) -> Tasks:
    p = place(handle, prompt_len=prompt_len)  # 4 blocks of 4: room for the prompt
    p.mm_ranges = [MultimodalRange(4, 8, item)]
    return Tasks(handle, placements=[p], chunks=[prompt_chunk(handle, 0, prompt_len)])


def test_a_drop_of_an_item_a_queued_chunk_reads_is_refused() -> None:
    ex = Dropping()
    eng = WorkerEngine(ex, BLOCK, 4, EOS, 64)
    eng.apply(with_item(1, "cat"))
    with pytest.raises(ProtocolError, match=r"'cat'.*handle 1"):
        eng.apply(Tasks(2, encoder_drops=["cat"]))
    eng.apply(Tasks(3, encoder_drops=["dog"]))  # nobody reads it: applied
    assert ex.dropped == [["dog"]]


def test_a_drop_after_the_chunk_ran_or_its_handle_was_preempted_is_applied() -> None:
    ex = Dropping()
    eng = WorkerEngine(ex, BLOCK, 4, EOS, 64)
    eng.apply(with_item(1, "cat"))
    eng.apply(with_item(2, "dog"))
    report = eng.step()  # both prompts ran
    assert report is not None and sorted(report.handles) == [1, 2]
    eng.apply(Tasks(3, encoder_drops=["cat"]))
    eng.apply(with_item(4, "owl"))
    eng.apply(Tasks(5, preempts=[4], encoder_drops=["owl"]))  # preempts go first
    assert ex.dropped == [["cat"], ["owl"]]


def test_model_executor_encodes_each_item_once_and_reads_it() -> None:
    cfg = ModelConfig()
    ex = PagedModelExecutor(cfg, num_blocks=16, block_size=BLOCK)
    item = [MultimodalRange(4, 8, "cat")]

    def work(handle: int, start: int, n: int, ranges: list[MultimodalRange]) -> SeqWork:
        tokens = [5] * n
        blocks = list(range(handle * 4, handle * 4 + 4))
        return SeqWork(
            handle, f"r{handle}", blocks, start, tokens, False, 0, place(1).sampling, ranges
        )

    ex.execute([work(0, 0, 8, item)])  # positions 4..7 of the item
    ex.execute([work(0, 8, 8, item), work(1, 0, 16, item)])  # the rest; another request
    assert (ex.encoder.encodes, ex.encoder.hits) == (1, 2)
    ex.drop_encoder_items(["cat"])
    ex.execute([work(2, 0, 16, item)])
    assert ex.encoder.encodes == 2  # dropped: encoded again
    # The placeholders read the item's output: another item gives other KV.
    k_cat = ex.backend.to_numpy(ex.k_cache[0])[2 * 4 * BLOCK : 2 * 4 * BLOCK + 16].copy()
    ex.execute([work(2, 0, 16, [MultimodalRange(4, 8, "dog")])])
    k_dog = ex.backend.to_numpy(ex.k_cache[0])[2 * 4 * BLOCK : 2 * 4 * BLOCK + 16]
    assert np.allclose(k_cat[:4], k_dog[:4]) and not np.allclose(k_cat[4:12], k_dog[4:12])


def test_encoder_outputs_are_deterministic_per_item() -> None:
    a, b = EncoderOutputs(32, 0, 1.0), EncoderOutputs(32, 0, 1.0)
    assert np.array_equal(a.get("cat", 4), b.get("cat", 4))
    assert not np.array_equal(a.get("cat", 4), a.get("dog", 4))

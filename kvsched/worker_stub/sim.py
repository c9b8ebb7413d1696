"""The `sim` executor: no model, step times from the cost model, reproducible tokens.

The token at position p of request r is `token_at(r, p)`, a hash of (crc32(r), p, seed): the
same under any chunking, preemption and recompute, or speculation. Speculation only changes how
many tokens a step yields: a step with k drafts accepts a pseudo-random a in [0, k] of them,
and its tokens are the oracle's tokens at the next a + 1 positions (as if those drafts had
matched). The executor never sleeps; its caller waits out `step_time_s`.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import numpy.typing as npt

from kvsched.worker_stub.costmodel import fit_for, step_time_s, step_time_s_of
from kvsched.worker_stub.executor import SeqWork, StepResult

# The storage tier's default bandwidth, GB/s: one 100 Gb/s RDMA NIC (Mooncake's transfer
# engine reaches about line rate on RDMA; over TCP on this 2-core box it measured ~1-2 GB/s,
# bench/storage_io.py).
STORAGE_GBPS = 12.5

_MASK64 = (1 << 64) - 1
_KV_MAGIC = b"kvsim1"


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """_mix64 of every element (uint64 arithmetic wraps, as the & _MASK64 above)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SimExecutor:
    """Executor whose steps cost what the fit says and whose tokens are a hash of the position.

    eos_every=n makes each sampled token EOS with probability 1/n (decided by the same hash), so
    outputs stop early after about n tokens; with None the sim never emits `eos_token_id`.
    """

    name = "sim"

    def __init__(
        self,
        gpu: str = "h100",
        speed: float = 1.0,
        zero_cost: bool = False,
        vocab_size: int = 32000,
        seed: int = 0,
        eos_token_id: int = 2,
        eos_every: int | None = None,
        block_bytes: int = 0,
        pcie_gbps: float = 50.0,
        storage_gbps: float = STORAGE_GBPS,
    ) -> None:
        """block_bytes: bytes of one KV block, what a host-tier copy moves over PCIe at
        pcie_gbps GB/s (0: copies are free); the copies of a step boundary add their time to
        the next step (they are on its critical path). Storage tier transfers (step 13) move
        a block's bytes at storage_gbps GB/s: fetches add their time to the next step like
        copies (its chunks read them); writes overlap it (the NIC reads pinned memory while
        the GPU computes): the step lasts at least as long as they do."""
        fit_for(gpu)  # validates the name
        if block_bytes < 0 or pcie_gbps <= 0 or storage_gbps <= 0:
            raise ValueError(
                f"need block_bytes >= 0, pcie_gbps > 0 and storage_gbps > 0, got "
                f"{block_bytes}, {pcie_gbps}, {storage_gbps}"
            )
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if vocab_size < 2 or not 0 <= eos_token_id < vocab_size:
            raise ValueError(
                f"need vocab_size >= 2 and 0 <= eos_token_id < vocab_size, "
                f"got {vocab_size} and {eos_token_id}"
            )
        if eos_every is not None and eos_every < 1:
            raise ValueError(f"eos_every must be >= 1 or None, got {eos_every}")
        self.gpu = gpu.lower()
        self.speed = speed
        self.zero_cost = zero_cost
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every
        self._seed = _mix64(seed)
        self._accept_salt = _mix64(seed ^ 0x5EED)
        self.num_steps = 0
        self._copy_s_per_block = block_bytes / (pcie_gbps * 1e9)
        self._copy_s = 0.0  # copies since the last step, in seconds
        self.num_copied_blocks = 0
        self._storage_s_per_block = block_bytes / (storage_gbps * 1e9)
        self._write_s = 0.0  # storage writes since the last step (they overlap it), seconds
        self._ahead_s = 0.0  # swap-ins ahead of their chunk since the last step (overlap it)
        self.num_stored_blocks = 0  # storage tier: blocks written, blocks fetched
        self.num_fetched_blocks = 0
        self.num_prefetched_blocks = 0  # storage -> host, beside the steps

    # ---- the storage tier: simulated (no store), only priced -----------------------------------
    def storage_copied(self, num_blocks: int, *, write: bool) -> None:
        """A storage write or fetch of num_blocks blocks ran at this step boundary."""
        if write:
            self.num_stored_blocks += num_blocks
            self._write_s += num_blocks * self._storage_s_per_block
        else:
            self.num_fetched_blocks += num_blocks
            self._copy_s += num_blocks * self._storage_s_per_block

    def storage_prefetched(self, num_blocks: int) -> None:
        """A storage -> host prefetch of num_blocks ran at this step boundary: beside the
        step, as writes (the NIC writes host memory while the GPU computes)."""
        self.num_prefetched_blocks += num_blocks
        self._write_s += num_blocks * self._storage_s_per_block

    # ---- the host tier: the sim holds no KV, it only prices the copies -----------------------
    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        self._copied(len(gpu_ids))

    def swap_in(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        self._copied(len(gpu_ids))

    # ---- copies ahead of their chunk (CacheConfig.swap_in_ahead): a copy stream, the NIC ----
    def copies_ahead(self, swapped: int, fetched: int) -> None:
        """Of the copies priced at this boundary (`swap_in`, `storage_copied`), these blocks
        are read by no chunk of the next step: they run beside it, not before it."""
        swap_s, fetch_s = swapped * self._copy_s_per_block, fetched * self._storage_s_per_block
        self._copy_s -= swap_s + fetch_s
        self._ahead_s += swap_s
        self._write_s += fetch_s

    def copies_read(self, swapped: int, fetched: int) -> None:
        """Blocks `copies_ahead` moved beside the step are read by a chunk of it after all
        (a later message at the same boundary): before it again."""
        swap_s, fetch_s = swapped * self._copy_s_per_block, fetched * self._storage_s_per_block
        self._ahead_s -= swap_s
        self._write_s -= fetch_s
        self._copy_s += swap_s + fetch_s

    def _copied(self, n: int) -> None:
        self.num_copied_blocks += n
        self._copy_s += n * self._copy_s_per_block

    def _with_copies(self, compute_s: float) -> float:
        """A step's time with the boundary's transfers: copies and fetches before it, writes
        and swap-ins ahead of their chunk alongside it."""
        copy_s, write_s, ahead_s = self._copy_s, self._write_s, self._ahead_s
        self._copy_s = self._write_s = self._ahead_s = 0.0
        if self.zero_cost:
            return compute_s
        return max(compute_s + copy_s / self.speed, max(write_s, ahead_s) / self.speed)

    def token_at(self, req_id: str, position: int) -> int:
        """The token the simulated model puts at `position` of `req_id`."""
        h = _mix64(((zlib.crc32(req_id.encode()) << 32) | position) ^ self._seed)
        if self.eos_every is not None and (h >> 40) % self.eos_every == 0:
            return self.eos_token_id
        token = h % (self.vocab_size - 1)
        return token + 1 if token >= self.eos_token_id else token

    # ---- the columnar decode path (WorkerEngine(columnar=True)) -------------------------------

    @staticmethod
    def request_key(req_id: str) -> int:
        """What `decode_tokens` needs to know of a request (taken once, at placement)."""
        return zlib.crc32(req_id.encode()) << 32

    def decode_tokens(
        self, keys: npt.NDArray[np.uint64], positions: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """token_at(req_id, positions[i]) for keys[i] = request_key(req_id), vectorized."""
        h = _mix64_array((keys | positions.astype(np.uint64)) ^ np.uint64(self._seed))
        tokens = (h % np.uint64(self.vocab_size - 1)).astype(np.int64)
        tokens += tokens >= self.eos_token_id
        if self.eos_every is not None:
            eos = (h >> np.uint64(40)) % np.uint64(self.eos_every) == 0
            tokens[eos] = self.eos_token_id
        return tokens

    def execute_columns(
        self,
        work: list[SeqWork],
        keys: npt.NDArray[np.uint64],
        positions: npt.NDArray[np.int64],
    ) -> tuple[StepResult, npt.NDArray[np.int64]]:
        """One step of `work` plus one plain decode (no drafts) per (keys[i], positions[i]): the
        decode feeds the token at positions[i] - 1 and samples positions[i]. Same tokens and
        step time as `execute` over work + those decodes as SeqWorks."""
        self.num_steps += 1
        tokens = [self._sample(w) for w in work]
        step_time = 0.0
        if not self.zero_cost:
            chunks, contexts, num_draft = _split_work(work)
            step_time = (
                step_time_s_of(
                    self.gpu,
                    chunks,
                    len(contexts) + len(positions),
                    sum(contexts) + int(positions.sum()),
                    num_draft,
                )
                / self.speed
            )
        return StepResult(tokens, self._with_copies(step_time)), self.decode_tokens(keys, positions)

    def num_accepted(self, w: SeqWork) -> int:
        """How many of w's drafts the simulated verification accepts: in [0, num_draft]."""
        if w.num_draft == 0:
            return 0
        h = _mix64(((zlib.crc32(w.req_id.encode()) << 32) | w.start) ^ self._accept_salt)
        return h % (w.num_draft + 1)

    def execute(self, work: list[SeqWork]) -> StepResult:
        self.num_steps += 1
        tokens = [self._sample(w) for w in work]
        return StepResult(tokens=tokens, step_time_s=self._with_copies(self.step_time_s(work)))

    def _sample(self, w: SeqWork) -> list[int]:
        if not w.sample:
            return []
        first = w.start + len(w.token_ids) - w.num_draft  # position after the last real token
        return [self.token_at(w.req_id, first + i) for i in range(self.num_accepted(w) + 1)]

    def step_time_s(self, work: list[SeqWork]) -> float:
        """The cost model's time for this batch, divided by speed (0 in zero-cost mode).

        A sampling SeqWork of [last] + drafts is a decode (memory-bound attention over its
        context); anything longer is a prefill chunk. A 1-token final chunk counts as a decode,
        which is what its attention costs.
        """
        if self.zero_cost:
            return 0.0
        chunks, contexts, num_draft = _split_work(work)
        return step_time_s(self.gpu, chunks, contexts, num_draft) / self.speed

    def export_kv(self, block_ids: list[int]) -> bytes:
        """A small blob standing for the KV: block count and a checksum of the source ids."""
        ids = struct.pack(f"<{len(block_ids)}q", *block_ids)
        return _KV_MAGIC + struct.pack("<II", len(block_ids), zlib.crc32(ids))

    def import_kv(self, block_ids: list[int], data: bytes) -> None:
        """Accept a blob from `export_kv` of as many blocks; ValueError otherwise."""
        size = len(_KV_MAGIC) + 8
        if len(data) != size or not data.startswith(_KV_MAGIC):
            raise ValueError("not a sim KV blob")
        (num_blocks, _) = struct.unpack("<II", data[len(_KV_MAGIC) :])
        if num_blocks != len(block_ids):
            raise ValueError(f"KV blob holds {num_blocks} blocks, asked to import {len(block_ids)}")

    def reset(self) -> None:
        """Nothing to forget: the sim holds no KV."""
        self._copy_s = self._write_s = 0.0


def _split_work(work: list[SeqWork]) -> tuple[list[tuple[int, int]], list[int], int]:
    """(prefill chunks as (length, start), decode context lengths, draft tokens) of a batch."""
    chunks: list[tuple[int, int]] = []
    contexts: list[int] = []
    num_draft = 0
    for w in work:
        if w.sample and len(w.token_ids) == w.num_draft + 1:
            contexts.append(w.start + len(w.token_ids))
            num_draft += w.num_draft
        else:
            chunks.append((len(w.token_ids), w.start))
    return chunks, contexts, num_draft

// The executor: what runs one batched forward pass over the paged KV cache.
//
// ============================================================================================
//  THIS IS WHERE A REAL MODEL PLUGS IN. ToyExecutor below stands where the model would run: it
//  has no weights and no KV, and "samples" the token at (request, position) from a hash. A real
//  worker implements Executor::Execute with its forward pass:
//    - for each SeqWork, write the KV of positions [start, start + token_ids.size()) into the
//      blocks of work.block_ids (position p lives in block_ids[p / block_size], row
//      p % block_size), attending over positions [0, start) already in those blocks;
//    - where work.sample is true, sample one token after the last position with
//      work.sampling (temperature, top_p, top_k, seed) and return it; return -1 elsewhere.
//  Everything else (which handles run, stop rules, pauses, reports) is the engine's job.
// ============================================================================================
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "kvsched/v1/common.pb.h"

namespace cppworker {

// One sequence's work in one step: a prefill chunk, or one decode position.
struct SeqWork {
  uint64_t handle;
  const std::string* request_id;
  const std::vector<uint32_t>* block_ids;  // the handle's whole block table
  uint32_t start;                          // position of token_ids[0]
  std::vector<int32_t> token_ids;          // a prompt chunk, or {last sampled token}
  bool sample;                             // sample the token at position start + size
  const kvsched::v1::SamplingParams* sampling;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // One step over the whole batch; one token per SeqWork (-1 where sample is false).
  virtual std::vector<int32_t> Execute(const std::vector<SeqWork>& batch) = 0;
  // Forget all KV: a worker that reconnects starts from an empty cache.
  virtual void Reset() = 0;
};

// The toy model. Its token at position p of request r is the same formula as kvsched's `sim`
// worker (kvsched/worker_stub/sim.py, SimExecutor.token_at), so a test can compute every
// expected output in Python: splitmix64 of (crc32(r) << 32 | p) ^ splitmix64(seed), folded into
// [0, vocab_size) without eos_token_id; with eos_every = n, also EOS when (hash >> 40) % n == 0.
class ToyExecutor : public Executor {
 public:
  ToyExecutor(uint64_t seed, int32_t eos_token_id, uint32_t eos_every, int step_us)
      : seed_(Mix64(seed)), eos_(eos_token_id), eos_every_(eos_every), step_us_(step_us) {}

  std::vector<int32_t> Execute(const std::vector<SeqWork>& batch) override {
    std::vector<int32_t> out;
    out.reserve(batch.size());
    for (const SeqWork& w : batch) {
      uint32_t position = w.start + static_cast<uint32_t>(w.token_ids.size());
      out.push_back(w.sample ? TokenAt(*w.request_id, position) : -1);
    }
    // Stands for the GPU's time: without it the toy would step (and report) as fast as the
    // CPU allows, which no real worker does.
    if (step_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(step_us_));
    return out;
  }

  void Reset() override {}  // no KV to forget

  int32_t TokenAt(const std::string& request_id, uint32_t position) const {
    uint64_t h = Mix64(((static_cast<uint64_t>(Crc32(request_id)) << 32) | position) ^ seed_);
    if (eos_every_ != 0 && (h >> 40) % eos_every_ == 0) return eos_;
    uint64_t token = h % (kVocabSize - 1);
    return static_cast<int32_t>(token >= static_cast<uint64_t>(eos_) ? token + 1 : token);
  }

  static constexpr uint64_t kVocabSize = 32000;

 private:
  static uint64_t Mix64(uint64_t x) {  // splitmix64's finaliser
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  }

  static uint32_t Crc32(const std::string& s) {  // zlib's crc32 (IEEE, reflected)
    uint32_t crc = 0xFFFFFFFFu;
    for (unsigned char c : s) {
      crc ^= c;
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
  }

  uint64_t seed_;
  int32_t eos_;
  uint32_t eos_every_;
  int step_us_;
};

}  // namespace cppworker

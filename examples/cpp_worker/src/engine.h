// The worker's slot state machine: apply the daemon's Tasks, run one step, fill a StepReport.
// The rules are the WorkerService comment of protos/kvsched/v1/worker_service.proto (steps 4-7).
//
// Positions and counters of one handle (prompt of 4 tokens, block_size 4, two blocks):
//
//   position        0    1    2    3  |  4    5    6    7
//   token           p0   p1   p2   p3 |  o0   o1   o2
//   chunk           [start=0, 4 tokens, last of the prompt] -> samples o0 (position 4)
//     after:        num_computed = 4              (o0 has no KV yet)
//   decode          feeds o0 at 4, writes KV(4), samples o1 -> num_computed 5
//
// So a decoding handle needs block room for position num_computed: it runs while
// num_computed < block_ids.size() * block_size, and pauses otherwise.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor.h"
#include "kvsched/v1/worker_service.pb.h"

namespace cppworker {

// The daemon sent tasks that cannot be right (a slot already taken, a chunk past the prompt).
// The worker drops the stream and reconnects with an empty cache.
struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Engine {
 public:
  // max_model_len: prompt + output tokens at most (the Welcome's; 0 = no limit). follower: a
  // rank > 0 of a tensor-parallel instance (see Place).
  Engine(Executor& executor, uint32_t block_size, uint32_t num_slots, int32_t eos_token_id,
         uint32_t max_model_len, bool follower);

  // Apply one Tasks message in the documented order (step 4). Throws ProtocolError.
  void Apply(const kvsched::v1::Tasks& tasks);
  // Whether Step() has something to do or to report.
  bool HasRunnable() const;
  // Run one step over every runnable handle and fill `report` (step 5 and 6); false when
  // there was nothing to do.
  bool Step(kvsched::v1::StepReport* report);

  uint64_t applied_seq() const { return applied_seq_; }
  size_t num_held() const { return held_.size(); }

 private:
  struct Seq {
    uint64_t handle;
    uint32_t slot;
    std::string request_id;
    std::vector<uint32_t> block_ids;
    uint32_t num_prefill;   // positions to have KV for before decoding (prompt + earlier outputs)
    uint32_t num_computed;  // positions [0, num_computed) have KV
    uint32_t num_output;    // outputs so far, this placement's and earlier ones
    int32_t last_token;     // the newest sampled token (no KV yet) once decoding
    bool decoding;          // the prompt is done
    bool paused;            // reported as lacking block room; an extension clears it
    std::map<uint32_t, std::vector<int32_t>> chunks;  // queued prompt chunks by start
    kvsched::v1::SamplingParams sampling;
  };

  uint64_t Capacity(const Seq& s) const { return s.block_ids.size() * uint64_t{block_size_}; }
  bool ChunkReady(const Seq& s) const;  // its next chunk is queued
  bool ChunkFits(const Seq& s) const;
  Seq* Lookup(uint64_t handle);  // nullptr, and acknowledged, when not held
  void Place(const kvsched::v1::Placement& p);
  void Free(uint64_t handle);
  kvsched::v1::FinishReason CheckStop(const Seq& s, int32_t token, uint32_t num_tokens) const;
  void AddOnce(std::vector<uint64_t>* list, uint64_t handle);

  Executor& executor_;
  uint32_t block_size_;
  uint32_t num_slots_;
  int32_t eos_token_id_;
  uint32_t max_model_len_;
  bool follower_;
  std::map<uint64_t, Seq> held_;   // by handle: handles are issued in increasing order
  std::vector<int64_t> occupant_;  // slot -> handle, -1 when free
  std::vector<uint64_t> acked_;    // for the next report, each handle once
  std::vector<uint64_t> failed_;
  uint64_t applied_seq_ = 0;
  uint64_t step_ = 0;
  bool warned_kv_sends_ = false;
};

}  // namespace cppworker

#include "engine.h"

#include <algorithm>
#include <chrono>
#include <iostream>

namespace cppworker {

using kvsched::v1::FinishReason;

Engine::Engine(Executor& executor, uint32_t block_size, uint32_t num_slots, int32_t eos_token_id,
               uint32_t max_model_len, bool follower)
    : executor_(executor),
      block_size_(block_size),
      num_slots_(num_slots),
      eos_token_id_(eos_token_id),
      max_model_len_(max_model_len),
      follower_(follower),
      occupant_(num_slots, -1) {}

// ---- applying tasks (step 4: preempts and aborts, placements, extensions, chunks, kv_sends,
// reset_prefix_cache) --------------------------------------------------------------------------

void Engine::Apply(const kvsched::v1::Tasks& t) {
  // Dropped handles free their slots and blocks first: a placement below may reuse them.
  // Each is acknowledged (step 7) whether or not this worker still held it.
  for (const auto* column : {&t.preempts(), &t.aborts()}) {
    for (uint64_t h : *column) {
      if (held_.count(h)) Free(h);
      AddOnce(&acked_, h);
    }
  }
  for (const auto& p : t.placements()) Place(p);

  const auto& ext = t.extensions();
  if (ext.handles_size() != ext.num_block_ids_size()) throw ProtocolError("extensions columns");
  for (int i = 0, at = 0; i < ext.handles_size(); ++i) {
    uint32_t n = ext.num_block_ids(i);
    if (at + static_cast<int64_t>(n) > ext.block_ids_size()) throw ProtocolError("block_ids");
    if (Seq* s = Lookup(ext.handles(i))) {
      s->block_ids.insert(s->block_ids.end(), ext.block_ids().begin() + at,
                          ext.block_ids().begin() + at + n);
      s->paused = false;  // it has room again (step 5)
    }
    at += n;
  }

  const auto& ch = t.chunks();
  if (ch.handles_size() != ch.starts_size() || ch.handles_size() != ch.num_tokens_size()) {
    throw ProtocolError("chunks columns differ in length");
  }
  for (int i = 0, at = 0; i < ch.handles_size(); ++i) {
    uint32_t n = ch.num_tokens(i), start = ch.starts(i);
    if (at + static_cast<int64_t>(n) > ch.token_ids_size()) throw ProtocolError("token_ids");
    Seq* s = Lookup(ch.handles(i));
    if (s != nullptr && !s->decoding && start >= s->num_computed) {  // else: stale, ignore
      if (n == 0 || start + n > s->num_prefill) {
        throw ProtocolError("chunk of handle " + std::to_string(s->handle) +
                            " is empty or past the prompt");
      }
      s->chunks[start].assign(ch.token_ids().begin() + at, ch.token_ids().begin() + at + n);
    }
    at += n;
  }

  // This example does not do prefill/decode disaggregation (its Hello names no
  // worker_address): a KV push it is asked for fails, and the daemon ends that request with
  // FINISH_REASON_ERROR. A P/D worker would push the prompt's KV once it is computed.
  for (uint64_t h : t.kv_sends().handles()) {
    if (Lookup(h) == nullptr) continue;
    if (!warned_kv_sends_) {
      std::cerr << "kv_sends: this worker does not push KV (no P/D); failing them\n";
      warned_kv_sends_ = true;
    }
    Free(h);
    AddOnce(&failed_, h);
  }
  // reset_prefix_cache: this worker keeps no cache keyed by block content, nothing to drop.
  applied_seq_ = std::max(applied_seq_, t.seq());
}

void Engine::Place(const kvsched::v1::Placement& p) {
  if (held_.count(p.handle())) {
    throw ProtocolError("handle " + std::to_string(p.handle()) + " is already placed");
  }
  if (p.slot() >= num_slots_) throw ProtocolError("slot " + std::to_string(p.slot()) + " out of range");
  if (occupant_[p.slot()] >= 0 && follower_) {
    // Real tensor-parallel ranks step in lockstep with rank 0. This toy's ranks > 0 step on
    // their own and may lag: rank 0 has finished the slot's occupant, so this rank drops it.
    Free(static_cast<uint64_t>(occupant_[p.slot()]));
  }
  if (occupant_[p.slot()] >= 0) {
    throw ProtocolError("slot " + std::to_string(p.slot()) + " still holds handle " +
                        std::to_string(occupant_[p.slot()]));
  }
  if (p.num_cached_tokens() > p.num_prefill_tokens()) throw ProtocolError("num_cached_tokens");
  // Decoding starts at once only when every position already has KV (a full prefix hit, or KV
  // pushed by a prefill instance). last_token_id alone does not say so: a recomputed request
  // may carry its last token while its positions still need prefill.
  bool decoding = p.num_cached_tokens() == p.num_prefill_tokens();
  if (decoding && p.last_token_id() < 0) {
    throw ProtocolError("handle " + std::to_string(p.handle()) + ": nothing to prefill, no token");
  }
  Seq s;
  s.handle = p.handle();
  s.slot = p.slot();
  s.request_id = p.request_id();
  s.block_ids.assign(p.block_ids().begin(), p.block_ids().end());
  s.num_prefill = p.num_prefill_tokens();
  s.num_computed = p.num_cached_tokens();
  s.num_output = p.num_output_tokens();
  s.last_token = decoding ? p.last_token_id() : -1;
  s.decoding = decoding;
  s.paused = false;
  s.sampling = p.sampling();
  occupant_[p.slot()] = static_cast<int64_t>(p.handle());
  held_.emplace(p.handle(), std::move(s));
}

Engine::Seq* Engine::Lookup(uint64_t handle) {
  auto it = held_.find(handle);
  if (it != held_.end()) return &it->second;
  AddOnce(&acked_, handle);  // a task for a handle already finished or dropped (step 7)
  return nullptr;
}

void Engine::Free(uint64_t handle) {
  auto it = held_.find(handle);
  occupant_[it->second.slot] = -1;
  held_.erase(it);
}

void Engine::AddOnce(std::vector<uint64_t>* list, uint64_t handle) {
  if (std::find(list->begin(), list->end(), handle) == list->end()) list->push_back(handle);
}

// ---- stepping (steps 5 and 6) -------------------------------------------------------------

bool Engine::ChunkReady(const Seq& s) const {
  return !s.decoding && s.chunks.count(s.num_computed) > 0;
}

bool Engine::ChunkFits(const Seq& s) const {
  return s.num_computed + s.chunks.at(s.num_computed).size() <= Capacity(s);
}

bool Engine::HasRunnable() const {
  if (!acked_.empty() || !failed_.empty()) return true;  // acknowledgements to report
  for (const auto& [h, s] : held_) {
    bool room = s.decoding ? s.num_computed < Capacity(s) : ChunkReady(s) && ChunkFits(s);
    bool newly_blocked = !s.paused && (s.decoding || ChunkReady(s)) && !room;
    if (room || newly_blocked) return true;
  }
  return false;
}

FinishReason Engine::CheckStop(const Seq& s, int32_t token, uint32_t num_tokens) const {
  // As the reference worker (and vLLM): length first (max_tokens, max_model_len); then EOS and
  // stop_token_ids, only once min_tokens are out. The stopping token is kept and reported.
  uint32_t out = s.num_output + 1;
  const auto& sp = s.sampling;
  int64_t max_tokens = sp.has_max_tokens() ? sp.max_tokens() : INT64_MAX;
  if (out >= max_tokens || (max_model_len_ != 0 && num_tokens + 1 >= max_model_len_)) {
    return kvsched::v1::FINISH_REASON_LENGTH;
  }
  if (static_cast<int64_t>(out) >= sp.min_tokens()) {
    bool eos = token == eos_token_id_ && !sp.ignore_eos();
    bool stop = std::find(sp.stop_token_ids().begin(), sp.stop_token_ids().end(), token) !=
                sp.stop_token_ids().end();
    if (eos || stop) return kvsched::v1::FINISH_REASON_STOP;
  }
  return kvsched::v1::FINISH_REASON_UNSPECIFIED;
}

bool Engine::Step(kvsched::v1::StepReport* r) {
  if (!HasRunnable()) return false;
  auto started = std::chrono::steady_clock::now();
  r->set_step(++step_);
  r->set_applied_seq(applied_seq_);

  // The batch: each handle's next prompt chunk if it fits, else one decode position if its
  // blocks have room. A handle without room is named in `paused` once, until an extension.
  std::vector<SeqWork> batch;
  std::vector<Seq*> seqs;
  for (auto& [h, s] : held_) {
    if (!s.decoding && !ChunkReady(s)) continue;  // waiting for its next chunk
    bool fits = s.decoding ? s.num_computed < Capacity(s) : ChunkFits(s);
    if (!fits) {
      if (!s.paused) r->add_paused(h);
      s.paused = true;
      continue;
    }
    SeqWork w{h, &s.request_id, &s.block_ids, s.num_computed, {}, true, &s.sampling};
    if (s.decoding) {
      w.token_ids = {s.last_token};
    } else {
      auto node = s.chunks.extract(s.num_computed);
      w.token_ids = std::move(node.mapped());
      w.sample = s.num_computed + w.token_ids.size() == s.num_prefill;  // the prompt's last
    }
    batch.push_back(std::move(w));
    seqs.push_back(&s);
  }

  std::vector<int32_t> tokens;
  if (!batch.empty()) tokens = executor_.Execute(batch);  // <- the forward pass

  // Report rows, parallel columns; finish_reasons always one per row, so that reports
  // merged by appending columns stay aligned.
  std::vector<uint64_t> finished;
  for (size_t i = 0; i < batch.size(); ++i) {
    Seq& s = *seqs[i];
    const SeqWork& w = batch[i];
    FinishReason reason = kvsched::v1::FINISH_REASON_UNSPECIFIED;
    if (!s.decoding) s.num_computed = w.start + w.token_ids.size();
    if (w.sample) {
      uint32_t num_tokens = s.decoding ? s.num_computed + 1 : s.num_computed;
      reason = CheckStop(s, tokens[i], num_tokens);
      if (s.decoding) s.num_computed += 1;  // the fed token's KV is now written
      s.num_output += 1;
      s.last_token = tokens[i];
      s.decoding = true;
      r->add_token_ids(tokens[i]);
    }
    r->add_handles(s.handle);
    r->add_num_computed(s.num_computed);
    r->add_num_new_tokens(w.sample ? 1 : 0);
    r->add_finish_reasons(reason);
    if (reason != kvsched::v1::FINISH_REASON_UNSPECIFIED) finished.push_back(s.handle);
  }
  for (uint64_t h : finished) Free(h);  // the slot is free once reported (step 6)

  for (uint64_t h : acked_) r->add_acked(h);
  for (uint64_t h : failed_) r->add_failed(h);
  acked_.clear();
  failed_.clear();
  r->set_step_time_ns(std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - started)
                          .count());
  return true;
}

}  // namespace cppworker

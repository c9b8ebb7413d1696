// A kvsched GPU worker in C++: one WorkerService.Connect stream to the daemon (hello, welcome,
// tasks in, step reports out, heartbeats both ways), reconnected with backoff when it breaks.
// The protocol is the WorkerService comment of protos/kvsched/v1/worker_service.proto; the
// numbers in comments ("step 4") are its steps. The model is an Executor (executor.h); the toy
// one used here hashes (request, position) into a token.
//
//   daemon --ConnectResponse--> reader thread --Inbox--> main thread: at each step boundary
//                                                         apply every Tasks received, step,
//   daemon <--ConnectRequest--------------------------- report; heartbeat when nothing
//                                                         else was sent for the interval
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "engine.h"
#include "executor.h"
#include "kvsched/v1/worker_service.grpc.pb.h"

namespace cppworker {
namespace {

using Clock = std::chrono::steady_clock;
using kvsched::v1::ConnectRequest;
using kvsched::v1::ConnectResponse;

constexpr uint32_t kProtocolVersion = 1;  // Hello/Welcome.protocol_version this worker speaks
constexpr size_t kMaxUnanswered = 2;      // reports in flight before later ones are merged

std::atomic<bool> g_stop{false};  // SIGTERM / SIGINT: leave

struct Options {
  std::string server = "127.0.0.1:50051";
  std::string instance = "i0";
  uint32_t rank = 0, world_size = 1;
  uint32_t num_blocks = 4096, block_size = 16, num_slots = 256;
  std::string model = "default";
  std::string token;        // sent as "authorization: Bearer TOKEN" when set
  uint64_t seed = 0;        // toy model
  int32_t eos_token_id = 2;
  uint32_t eos_every = 0;   // toy model: ~1 in n tokens is EOS; 0 = never
  int step_us = 1000;       // toy model: simulated GPU time per step
  double heartbeat_s = 1.0;  // until the Welcome says otherwise
  double daemon_timeout_s = 0;  // leave a daemon silent this long (0: never)
  double backoff_min_s = 0.1, backoff_max_s = 5.0;
};

void Log(const std::string& line) {
  auto now = std::chrono::system_clock::now().time_since_epoch();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now).count();
  std::cerr << ms / 1000 << "." << (ms % 1000) / 100 << (ms % 100) / 10 << ms % 10
            << " cpp_worker: " << line << std::endl;
}

// What the reader thread hands to the step loop.
class Inbox {
 public:
  void Push(ConnectResponse msg) {
    std::lock_guard<std::mutex> lock(mu_);
    items_.push_back(std::move(msg));
    cv_.notify_one();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_one();
  }
  // Everything received so far; waits until `deadline` when there is nothing yet.
  std::deque<ConnectResponse> Take(Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return !items_.empty() || closed_; });
    return std::exchange(items_, {});
  }
  bool closed() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_ && items_.empty();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ConnectResponse> items_;
  bool closed_ = false;
};

enum class End { kDone, kRetry, kRefused };

// Printed when the worker exits (the integration test reads it).
struct Stats {
  uint64_t connects = 0, steps = 0, reports = 0, tokens = 0, paused = 0, acked = 0, failed = 0,
           heartbeats = 0;
  std::string Line() const {
    return "stats: connects " + std::to_string(connects) + ", steps " + std::to_string(steps) +
           ", reports " + std::to_string(reports) + ", tokens " + std::to_string(tokens) +
           ", paused " + std::to_string(paused) + ", acked " + std::to_string(acked) +
           ", failed " + std::to_string(failed) + ", heartbeats " + std::to_string(heartbeats);
  }
};

class Worker {
 public:
  explicit Worker(Options o)
      : o_(std::move(o)),
        stub_(kvsched::v1::WorkerService::NewStub(
            grpc::CreateChannel(o_.server, grpc::InsecureChannelCredentials()))) {}

  // Serve until the daemon ends the stream with OK or a signal; retry a broken stream with
  // jittered exponential backoff. 0: left cleanly; 1: the daemon refused this worker.
  int Run() {
    std::mt19937 rng(std::random_device{}());
    double backoff = o_.backoff_min_s;
    while (!g_stop) {
      auto started = Clock::now();
      End end = Session();
      if (end != End::kRetry) {
        Log(stats_.Line());
        return end == End::kDone ? 0 : 1;
      }
      if (Clock::now() - started >= std::chrono::duration<double>(o_.backoff_max_s)) {
        backoff = o_.backoff_min_s;  // it ran a while: not a crash loop
      }
      double delay = backoff * std::uniform_real_distribution<double>(0.5, 1.0)(rng);
      backoff = std::min(2 * backoff, o_.backoff_max_s);
      Log("reconnecting to " + o_.server + " in " + std::to_string(delay) + " s");
      auto until = Clock::now() + std::chrono::duration<double>(delay);
      while (!g_stop && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    Log(stats_.Line());
    return 0;
  }

 private:
  // One Connect stream, from an empty cache (step 2).
  End Session() {
    grpc::ClientContext ctx;
    if (!o_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + o_.token);
    auto stream = stub_->Connect(&ctx);
    stats_.connects++;
    Inbox inbox;
    std::thread reader([&] {
      ConnectResponse msg;
      while (stream->Read(&msg)) inbox.Push(std::move(msg));
      inbox.Close();
    });
    stream_ = stream.get();
    unanswered_.clear();
    held_.reset();

    End end = End::kRetry;
    bool left = false;  // this worker ended the stream (signal, protocol error, silence)
    ConnectRequest hello;
    auto* h = hello.mutable_hello();
    h->set_instance_id(o_.instance);
    h->set_rank(o_.rank);
    h->set_world_size(o_.world_size);
    h->set_num_gpu_blocks(o_.num_blocks);
    h->set_block_size(o_.block_size);
    h->set_num_slots(o_.num_slots);
    h->set_model(o_.model);
    h->set_protocol_version(kProtocolVersion);
    h->set_executor("cpp-toy");  // worker_address stays empty: no KV pushes (no P/D)
    if (Send(hello)) {
      try {
        left = Serve(inbox, &end);
      } catch (const ProtocolError& e) {
        Log(std::string("dropping the stream: the daemon sent bad tasks: ") + e.what());
        left = true;
      }
    }
    if (left) {
      stream->WritesDone();
      ctx.TryCancel();
    }
    reader.join();
    grpc::Status status = stream->Finish();
    stream_ = nullptr;
    if (left) return end;
    if (status.ok()) {
      Log("the daemon ended the stream (OK): leaving");
      return End::kDone;
    }
    Log("stream to " + o_.server + " broke: " + std::to_string(status.error_code()) + ": " +
        status.error_message());
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
        status.error_message().find("already connected") != std::string::npos) {
      return End::kRetry;  // the daemon still holds this rank's old stream: it drops it soon
    }
    switch (status.error_code()) {  // the daemon refused this worker: the same hello won't help
      case grpc::StatusCode::FAILED_PRECONDITION:
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::UNAUTHENTICATED:
      case grpc::StatusCode::PERMISSION_DENIED:
      case grpc::StatusCode::UNIMPLEMENTED:
        return End::kRefused;
      default:
        return End::kRetry;
    }
  }

  // Welcome, then the step loop. True when this worker chose to leave the stream (with *end
  // set); false when the stream ended under it.
  bool Serve(Inbox& inbox, End* end) {
    std::optional<kvsched::v1::Welcome> welcome;
    std::deque<ConnectResponse> early;  // anything after the welcome in the same batch
    auto give_up = Clock::now() + std::chrono::seconds(30);
    while (!welcome) {
      if (inbox.closed()) return false;
      if (g_stop || Clock::now() > give_up) return *end = End::kRetry, true;
      for (auto& m : inbox.Take(Clock::now() + std::chrono::milliseconds(100))) {
        if (welcome) {
          early.push_back(std::move(m));
        } else if (m.has_welcome()) {
          welcome = m.welcome();
        }  // a daemon sends welcome first; anything before it is ignored
      }
    }
    const auto& w = *welcome;
    if (w.protocol_version() != kProtocolVersion) {
      Log("daemon speaks worker protocol " + std::to_string(w.protocol_version()));
      return *end = End::kRefused, true;
    }
    if (w.role() == kvsched::v1::INSTANCE_ROLE_PREFILL ||
        w.role() == kvsched::v1::INSTANCE_ROLE_DECODE) {
      Log("this example does not do prefill/decode disaggregation; configure a mixed instance");
      return *end = End::kRefused, true;
    }
    // num_speculative_tokens > 0 is served by proposing no drafts: one token per decode step
    // is a valid outcome of speculation (every draft rejected, or none proposed).
    if (w.heartbeat_interval_ns() > 0) heartbeat_s_ = w.heartbeat_interval_ns() / 1e9;
    paced_ = w.answers_reports();
    uint32_t block_size = w.block_size() ? w.block_size() : o_.block_size;
    ToyExecutor executor(o_.seed, o_.eos_token_id, o_.eos_every, o_.step_us);
    Engine engine(executor, block_size, o_.num_slots, o_.eos_token_id, w.max_model_len(),
                  /*follower=*/o_.rank > 0);
    Log("welcomed by " + o_.server + " as " + o_.instance + " rank " + std::to_string(o_.rank) +
        "/" + std::to_string(o_.world_size) + ": block_size " + std::to_string(block_size) +
        ", max_model_len " + std::to_string(w.max_model_len()) + ", heartbeat " +
        std::to_string(heartbeat_s_) + " s, answers_reports " + (paced_ ? "yes" : "no"));
    last_heard_ = Clock::now();
    for (auto& m : early) Accept(engine, m);

    while (true) {
      if (g_stop) return *end = End::kDone, true;
      // Step boundary: apply every Tasks received, oldest first (step 4).
      for (auto& m : inbox.Take(Clock::now())) Accept(engine, m);
      if (inbox.closed()) return false;  // the daemon ended the stream (or it broke)
      auto interval = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(heartbeat_s_));
      if (engine.HasRunnable()) {
        // Never wait for the daemon while there is runnable work (step 5).
        ConnectRequest msg;
        engine.Step(msg.mutable_report());
        const auto& r = msg.report();
        stats_.steps++;
        stats_.tokens += r.token_ids_size();
        stats_.paused += r.paused_size();
        stats_.acked += r.acked_size();
        stats_.failed += r.failed_size();
        if (o_.rank == 0 && !Report(std::move(msg))) return false;  // ranks > 0 never report
      } else {
        // Idle: wait for tasks, but no longer than the next heartbeat is due.
        auto tick = Clock::now() + std::chrono::milliseconds(100);  // to notice signals
        for (auto& m : inbox.Take(std::min(last_sent_ + interval, tick))) Accept(engine, m);
      }
      // Step 8: a heartbeat when nothing else was sent for the interval (ranks > 0, and a
      // rank 0 whose reports are held back, send nothing else).
      if (Clock::now() >= last_sent_ + interval) {
        ConnectRequest hb;
        hb.mutable_heartbeat()->set_time_ns(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
        if (!Send(hb)) return false;
        stats_.heartbeats++;
      }
      if (o_.daemon_timeout_s > 0 &&
          Clock::now() - last_heard_ > std::chrono::duration<double>(o_.daemon_timeout_s)) {
        Log("the daemon has been silent too long: reconnecting");
        return *end = End::kRetry, true;
      }
    }
  }

  // One message from the daemon, at a step boundary.
  void Accept(Engine& engine, const ConnectResponse& m) {
    last_heard_ = Clock::now();
    if (m.has_tasks()) {
      engine.Apply(m.tasks());
      Answered(m.tasks().report_step());
    } else if (m.has_welcome()) {
      Log("ignoring a second welcome on one stream");
    }
    // heartbeat: the message itself is the news. peers: only prefill workers push KV.
  }

  // Send a step's report, or hold it while kMaxUnanswered reports wait for the daemon's answer
  // (Welcome.answers_reports): held reports merge into one (columns appended, the later step
  // and applied_seq), sent as soon as an answer comes. False when the stream broke.
  bool Report(ConnectRequest msg) {
    if (held_) {
      held_->MergeFrom(msg);
      return true;
    }
    if (paced_ && unanswered_.size() >= kMaxUnanswered) {
      held_ = std::move(msg);
      return true;
    }
    if (paced_) unanswered_.push_back(msg.report().step());
    stats_.reports++;
    return Send(msg);
  }

  // A Tasks message says the daemon applied reports up to report_step.
  void Answered(uint64_t report_step) {
    while (!unanswered_.empty() && unanswered_.front() <= report_step) unanswered_.pop_front();
    if (held_ && unanswered_.size() < kMaxUnanswered) {
      unanswered_.push_back(held_->report().step());
      stats_.reports++;
      Send(*held_);  // a failure shows up as the stream ending
      held_.reset();
    }
  }

  bool Send(const ConnectRequest& msg) {
    last_sent_ = Clock::now();
    return stream_->Write(msg);
  }

  Options o_;
  std::unique_ptr<kvsched::v1::WorkerService::Stub> stub_;
  grpc::ClientReaderWriter<ConnectRequest, ConnectResponse>* stream_ = nullptr;
  double heartbeat_s_ = o_.heartbeat_s;
  bool paced_ = false;
  std::deque<uint64_t> unanswered_;  // steps of reports sent and not yet answered
  std::optional<ConnectRequest> held_;
  Clock::time_point last_sent_, last_heard_;
  Stats stats_;
};

void Usage() {
  std::cerr << "usage: cpp_worker [--server HOST:PORT] [--instance ID] [--rank N] "
               "[--world-size N]\n  [--num-blocks N] [--block-size N] [--num-slots N] "
               "[--model NAME] [--token TOKEN]\n  [--seed N] [--eos-token-id N] "
               "[--eos-every N] [--step-us N] [--daemon-timeout-s S]\n";
}

}  // namespace
}  // namespace cppworker

int main(int argc, char** argv) {
  using namespace cppworker;
  Options o;
  if (const char* t = std::getenv("KVSCHED_TOKEN")) o.token = t;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) return Usage(), 2;
    std::string v = argv[++i];
    try {
      if (flag == "--server") o.server = v;
      else if (flag == "--instance") o.instance = v;
      else if (flag == "--rank") o.rank = std::stoul(v);
      else if (flag == "--world-size") o.world_size = std::stoul(v);
      else if (flag == "--num-blocks") o.num_blocks = std::stoul(v);
      else if (flag == "--block-size") o.block_size = std::stoul(v);
      else if (flag == "--num-slots") o.num_slots = std::stoul(v);
      else if (flag == "--model") o.model = v;
      else if (flag == "--token") o.token = v;
      else if (flag == "--seed") o.seed = std::stoull(v);
      else if (flag == "--eos-token-id") o.eos_token_id = std::stoi(v);
      else if (flag == "--eos-every") o.eos_every = std::stoul(v);
      else if (flag == "--step-us") o.step_us = std::stoi(v);
      else if (flag == "--daemon-timeout-s") o.daemon_timeout_s = std::stod(v);
      else return Usage(), 2;
    } catch (const std::exception&) {
      std::cerr << "bad value for " << flag << ": " << v << "\n";
      return 2;
    }
  }
  if (o.rank >= o.world_size || o.num_slots == 0 || o.block_size == 0 || o.num_blocks == 0) {
    std::cerr << "need rank < world-size and non-zero sizes\n";
    return 2;
  }
  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::signal(SIGINT, [](int) { g_stop = true; });
  Worker worker(o);
  return worker.Run();
}

// capgraph host build: the every-step loop of the host build in C++ (the Builder of
// host_build.h) and its tvm-ffi entry point, make_builder.
//
// Per guided request of a step: accept the new token, fill the request's first bitmask row,
// clear the padding ids, check the row for a dead end, mark it in the token mask; then for
// each draft token: accept it, fill the next row, and so on, stopping where the Python
// reference build (capgraph/build/python.py, PythonBuild._fill_sequential) stops.
//
// What Python does around it: which requests take this path and their checks
// (capgraph/build/python.py, select), counters and statuses (capgraph/build/native.py), what a
// status means for the request (GuidedDecoder._interpret); this loop reports per request a
// status and how many tokens it accepted and rows it guided.
// python_entry.cc runs the same Builder from a CPython call without a Python loop.
// The requests of a large step run on the Builder's fill threads too (FillPool, RunEntries,
// FillChoice): they are independent, so the results are those of one thread.
//
// Compiled at run time with python_entry.cc into one library by capgraph/jit.py (for
// capgraph/build/library.py: a C++17 compiler and tvm-ffi's headers, cached on disk), never
// at import.

#include "host_build.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <pthread.h>  // pthread_setname_np, pthread_sigmask
#include <signal.h>
#include <unistd.h>  // getpid: a forked child starts its own pool

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

namespace capgraph {

// The fill threads of one Builder: started by its first parallel step, parked on a condition
// variable between steps, joined by Stop (ClosePool, ~Builder). A parallel section publishes
// its requests; each thread that joins it (the caller always does) claims requests one at a
// time from a shared counter until none is left, so a slow request does not hold up the
// others. The caller then closes the section (a thread woken later finds nothing to join) and
// waits until every thread that joined has left it: the section's data, on the caller's
// stack, outlives every use. Pool threads never take the GIL and touch no Python object
// (a matcher method handed in from Python may take it itself, as on the caller's thread).
class FillPool {
 public:
  struct Section {
    const Builder* builder;
    const void* context;
    Builder::EntryFn entry;
    std::string* errors;  // one per request
    int64_t n;
  };

  FillPool() : pid_(getpid()) {}
  FillPool(const FillPool&) = delete;
  FillPool& operator=(const FillPool&) = delete;
  ~FillPool() { Stop(); }

  // The process that started the threads (a forked child has none of them).
  pid_t pid() const { return pid_; }

  // Run the section on the calling thread and up to `workers` pool threads (started here as
  // needed; fewer where the system refuses a thread); how many threads ran requests, the
  // caller included, in *threads, and how many requests the pool threads ran in *pooled.
  void Run(const Section& section, int64_t workers, int64_t* threads, int64_t* pooled) {
    workers = Grow(workers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      section_ = section;
      next_.store(0, std::memory_order_relaxed);
      ++generation_;
      open_ = true;
      joined_ = pooled_ = 0;
      wanted_ = workers;
    }
    if (workers == static_cast<int64_t>(threads_.size())) {
      wake_.notify_all();
    } else {
      for (int64_t i = 0; i < workers; ++i) wake_.notify_one();
    }
    Claim(section);
    // a thread still in the section is running its last request (a few microseconds): wait
    // for it spinning a little before sleeping, which costs a wake-up of its own
    const int64_t deadline = NowNs() + kSpinNs;
    while (busy_.load(std::memory_order_acquire) != 0 && NowNs() < deadline) CpuRelax();
    std::unique_lock<std::mutex> lock(mu_);
    open_ = false;
    left_.wait(lock, [this] { return busy_.load(std::memory_order_relaxed) == 0; });
    *threads = 1 + joined_;
    *pooled = pooled_;
  }

  // End and join the threads (each finishes the section it joined first).
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }

  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

 private:
  static constexpr const char* kThreadName = "capgraph-fill";  // as profilers, /proc show it
  static constexpr int64_t kSpinNs = 20000;  // the caller's spin before it sleeps

  static void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Start threads up to `wanted`; how many there are (at most `wanted` are woken).
  int64_t Grow(int64_t wanted) {
    while (static_cast<int64_t>(threads_.size()) < wanted) {
      uint64_t generation;
      {
        std::lock_guard<std::mutex> lock(mu_);
        generation = generation_;
      }
      try {
        threads_.emplace_back(&FillPool::Work, this, generation);
      } catch (const std::system_error&) {
        break;  // (the threads there are run the section; the caller runs whatever is left)
      }
#ifdef __linux__
      pthread_setname_np(threads_.back().native_handle(), kThreadName);
#endif
    }
    return std::min<int64_t>(wanted, size());
  }

  // Run requests of the section until none is left, on this thread's own budget clock; how
  // many this thread ran.
  int64_t Claim(const Section& s) {
    Builder::StepClock clock_state;
    Builder::StepClock* clock = s.builder->StartClock(&clock_state);
    int64_t ran = 0;
    for (int64_t k; (k = next_.fetch_add(1, std::memory_order_relaxed)) < s.n; ++ran) {
      s.entry(s.context, k, clock, s.errors + k);
    }
    return ran;
  }

  void Work(uint64_t seen) {
    sigset_t all;  // signals go to the process's other threads (Python's handlers among them)
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] {
        return stop_ || (generation_ != seen && open_ && joined_ < wanted_);
      });
      if (stop_) return;
      seen = generation_;
      if (next_.load(std::memory_order_relaxed) >= section_.n) continue;  // (woken too late)
      ++joined_;
      busy_.fetch_add(1, std::memory_order_relaxed);
      const Section section = section_;
      lock.unlock();
      const int64_t ran = Claim(section);
      lock.lock();
      pooled_ += ran;
      if (busy_.fetch_sub(1, std::memory_order_release) == 1 && !open_) left_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;  // a section opened, or stop
  std::condition_variable left_;  // the last thread in a closed section left it
  std::vector<std::thread> threads_;  // (only the thread that runs sections changes it)
  std::atomic<int64_t> next_{0};  // the next request to claim
  // under mu_:
  Section section_{};
  uint64_t generation_ = 0;  // sections opened so far
  bool open_ = false, stop_ = false;
  int64_t wanted_ = 0, joined_ = 0, pooled_ = 0;
  std::atomic<int64_t> busy_{0};  // threads in the section (changed under mu_, read outside)
  const pid_t pid_;
};

Builder::Builder() = default;

Builder::~Builder() {
  if (pool_ != nullptr && pool_->pid() != getpid()) {
    (void)pool_.release();  // a forked child: the parent's threads are not here to join
  }
}

bool Builder::IsStop(int64_t token) const {
  for (int64_t s : stop_ids) {
    if (s == token) return true;
  }
  return false;
}

int32_t* Builder::Row(int64_t row) const {
  return static_cast<int32_t*>(bitmask.data_ptr()) + row * words;
}

// Padding ids are never allowed (SlotState.clear_tail).
void Builder::ClearTail(int64_t row) const {
  if (clear_word < 0) return;
  int32_t* r = Row(row);
  int64_t w = clear_word;
  if (clear_keep) {
    r[w] = static_cast<int32_t>(static_cast<uint32_t>(r[w]) & clear_keep);
    ++w;
  }
  if (w < words) std::memset(r + w, 0, static_cast<size_t>(words - w) * sizeof(int32_t));
}

// True when the row allows some id below vocab_size_padded (SlotState.dead_rows).
bool Builder::HasValidToken(int64_t row) const {
  const int32_t* r = Row(row);
  for (int64_t w = 0; w < full_words; ++w) {
    if (r[w]) return true;
  }
  return tail_mask && (static_cast<uint32_t>(r[full_words]) & tail_mask);
}

// Accept one token; sets *terminated when it was a stop token that ended the grammar. With a
// guard, a token whose bytes are not UTF-8 after the text so far is refused first.
bool Builder::Accept(const ObjectRef& m, int64_t token, bool* terminated,
                     Utf8Guard* guard) const {
  uint8_t next = 0;
  if (guard != nullptr) {
    next = Utf8Next(*guard, token);
    if (next == kUtf8Invalid) return false;
  }
  bool ok = accept(m, token, false).cast<bool>();
  if (ok && guard != nullptr) guard->Push(next);
  if (ok && IsStop(token)) *terminated = is_terminated(m).cast<bool>();
  return ok;
}

uint8_t Builder::Utf8Next(const Utf8Guard& guard, int64_t token) const {
  if (token < 0 || token >= utf8_vocab) return kUtf8Invalid;
  const uint8_t* trans = static_cast<const uint8_t*>(utf8_trans.data_ptr());
  return trans[static_cast<int64_t>(guard.State()) * utf8_vocab + token];
}

void Builder::Utf8Mask(int64_t row, const Utf8Guard& guard) const {
  int32_t* r = Row(row);
  const uint8_t state = guard.State();
  if (state == 0) {
    const size_t n = utf8_start_words.size();
    for (size_t k = 0; k < n; ++k) r[utf8_start_words[k]] &= utf8_start_masks[k];
    return;
  }
  const int32_t* allowed = static_cast<const int32_t*>(utf8_allowed.data_ptr()) + state * words;
  for (int64_t w = 0; w < words; ++w) r[w] &= allowed[w];
}

// The guards by the FFI object of their matcher (utf8_guard_new / utf8_guard_drop): the
// registry holds one count of each, Python's wrapper one, and each GuardRef one while it
// lives; the last release frees it.
namespace {
std::mutex g_guards_mu;
std::unordered_map<const void*, Utf8Guard*>& Guards() {
  static auto* guards = new std::unordered_map<const void*, Utf8Guard*>();  // (never freed:
  return *guards;  // a pool thread may look one up while the process exits)
}
void ReleaseGuard(Utf8Guard* g) {
  if (g != nullptr && g->refs.fetch_sub(1) == 1) delete g;
}
}  // namespace

GuardRef::GuardRef(const void* object) {
  if (object == nullptr) return;
  std::lock_guard<std::mutex> lock(g_guards_mu);
  auto it = Guards().find(object);
  if (it != Guards().end()) {
    guard_ = it->second;
    guard_->refs.fetch_add(1);
  }
}

GuardRef::~GuardRef() { ReleaseGuard(guard_); }

Utf8Guard* NewGuard(const void* object) {
  auto* g = new Utf8Guard();
  g->refs.store(2);  // (the registry's and the caller's)
  std::lock_guard<std::mutex> lock(g_guards_mu);
  Utf8Guard*& slot = Guards()[object];
  ReleaseGuard(slot);  // (a dead object's guard whose address the new object took)
  slot = g;
  return g;
}

void DropGuard(const void* object, Utf8Guard* g) {
  {
    std::lock_guard<std::mutex> lock(g_guards_mu);
    auto it = Guards().find(object);
    if (it != Guards().end() && it->second == g) {
      Guards().erase(it);
      ReleaseGuard(g);  // (the registry's)
    }
  }
  ReleaseGuard(g);  // (the caller's)
}

// This thread's clock for a step, or nullptr without a budget.
Builder::StepClock* Builder::StartClock(StepClock* clock) const {
  if (!budget_ns) return nullptr;
  // the anchor outlives the step (a thread's CPU clock only grows), so that back-to-back
  // steps do not each read the CPU clock
  static thread_local StepClock::Anchor anchor;
  clock->anchor = &anchor;
  clock->last = NowNs();
  if (clock->last - anchor.wall > budget_ns / 4) anchor = {clock->last, ThreadCpuNs()};
  return clock;
}

// Whether the request that ends now went over the budget (reads the clock, moves it on):
// in wall time, and in this thread's CPU time (a preempted thread, or one waiting for the
// GIL or at nice 19 behind the caller's threads, spends wall time, not the budget); its wall
// milliseconds in *ms.
//
// The CPU clock is a system call, so it is not read per request: the thread keeps an anchor
// (a wall time and its CPU time then), moved to a request's start whenever the last one is
// over a quarter of the budget old. A request's CPU time is at least the CPU time since the
// anchor less the wall time between the anchor and its start (whatever ran then spent at most
// that much CPU): never more than its own, and at most a quarter of the budget less. So a
// request over 1.25 budgets of CPU always fails, one within the budget never does, and a
// thread reads the CPU clock once per quarter budget of wall time (and once per overrun).
bool Builder::OverBudget(StepClock* clock, double* ms) const {
  StepClock::Anchor& anchor = *clock->anchor;
  const int64_t now = NowNs();
  const int64_t start = clock->last;
  clock->last = now;
  bool over = false;
  if (now - start > budget_ns) {
    *ms = static_cast<double>(now - start) / 1e6;
    const int64_t cpu_now = ThreadCpuNs();
    over = cpu_now - anchor.cpu - (start - anchor.wall) > budget_ns;
    anchor = {now, cpu_now};
  } else if (now - anchor.wall > budget_ns / 4) {
    anchor = {now, ThreadCpuNs()};
  }
  return over;
}

// One request: accept `token` (< 0: none, the matcher was created this step), fill its
// rows from `offset`, then follow its `nd` drafts (drafts[i] is the i-th). Writes
// {status, accepted, guided} to o3; a fault's message to *error.
//
// With a budget (`clock`), a request that would otherwise be plainly OK and took longer
// ends with kOverBudget: its rows unmasked, its counts zero (Python drops its matcher), the
// milliseconds measured written to *error. It is measured once, at its end: xgrammar's
// calls cannot be interrupted, and one clock read per request keeps the common step's cost
// within noise, so a slow request costs at most its own rows' calls, in one step.
void Builder::RunOne(const ObjectRef& m, int64_t token, int64_t offset, int64_t nd,
                     Drafts drafts, int64_t draft_len, int64_t rows, int32_t* mask, int32_t* o3,
                     StepClock* clock, std::string* error) const {
  int32_t status = kOk;
  int32_t accepted = 0, guided = 0;
  bool terminated = false;
  bool ended = false;  // its new token ended the grammar: done, never over budget (as Python)
  const GuardRef guard_ref(utf8_trans.defined() ? m.get() : nullptr);
  Utf8Guard* guard = guard_ref.get();
  try {
    bool go = true;
    if (token >= 0) {
      if (!Accept(m, token, &terminated, guard)) {
        status = kRejected;
        go = false;
      } else {
        ++accepted;
        go = !terminated;
        ended = terminated;
      }
    }
    for (int64_t i = 0; go; ++i) {
      const int64_t row = offset + i;
      if (row < 0 || row >= rows) {
        TVM_FFI_THROW(IndexError) << "host build: row " << row << " is outside the " << rows
                                  << "-row bitmask";
      }
      fill(m, bitmask, row, false);
      if (guard != nullptr) Utf8Mask(row, *guard);
      ClearTail(row);
      if (!HasValidToken(row)) {
        if (i == 0) status = kDeadEnd;
        break;  // a dead draft position stays unguided (as PythonBuild: no status)
      }
      ++guided;
      mask[row] = 1;
      if (i >= draft_len || i >= nd) break;
      if (!Accept(m, drafts[i], &terminated, guard)) break;  // the draft left the grammar
      ++accepted;
      if (terminated) break;
    }
  } catch (const tvm::ffi::Error& e) {
    status = kFault;
    *error = e.kind() + ": " + e.message();
  } catch (const std::exception& e) {
    status = kFault;
    *error = std::string("RuntimeError: ") + e.what();
  }
  double ms = 0;
  if (clock != nullptr && OverBudget(clock, &ms) && status == kOk && !ended) {
    for (int64_t r = offset; r < offset + guided; ++r) mask[r] = 0;  // (the guided rows)
    status = kOverBudget;
    accepted = guided = 0;
    terminated = false;  // (its matcher is dropped)
    *error = std::to_string(ms);
  }
  if (terminated) status |= kTerminated;
  o3[0] = status;
  o3[1] = accepted;
  o3[2] = guided;
}

// Zero token_mask[:clear_rows] (the step's layout rows start unmasked) and the errors.
int32_t* Builder::BeginStep(int64_t clear_rows) {
  const int64_t rows = bitmask.size(0);
  if (clear_rows < 0 || clear_rows > rows) {
    TVM_FFI_THROW(ValueError) << "host build: clear_rows " << clear_rows << " is outside [0, "
                              << rows << "]";
  }
  int32_t* mask = static_cast<int32_t*>(token_mask.data_ptr());
  std::memset(mask, 0, static_cast<size_t>(clear_rows) * sizeof(int32_t));
  errors.clear();
  return mask;
}

void Builder::RunEntries(int64_t n, const int32_t* out3, bool parallel,
                         const void* context, EntryFn entry) {
  std::lock_guard<std::mutex> hold(pool_mu_);
  last_start_ns = NowNs();
  if (static_cast<int64_t>(entry_errors_.size()) < n) entry_errors_.resize(n);
  std::string* step_errors = entry_errors_.data();
  const int64_t workers = std::min(fill_threads, n) - 1;
  const bool eligible = parallel && workers > 0 && n >= pool_min_requests;
  const bool pooled = eligible && choice.UsePool();
  bool started = false;  // this step started pool threads
  if (pooled) {
    if (pool_ != nullptr && pool_->pid() != getpid()) {
      (void)pool_.release();  // a forked child: the parent's threads are not here
    }
    if (pool_ == nullptr) pool_ = std::make_unique<FillPool>();
    const int64_t had = pool_->size();
    pool_->Run(FillPool::Section{this, context, entry, step_errors, n}, workers, &last_threads,
               &last_pool_requests);
    started = pool_->size() > had;
  } else {
    StepClock clock_state;
    StepClock* clock = StartClock(&clock_state);
    for (int64_t k = 0; k < n; ++k) entry(context, k, clock, step_errors + k);
    last_threads = n > 0 ? 1 : 0;
    last_pool_requests = 0;
  }
  last_end_ns = NowNs();
  // (a step that started threads paid for their start, once: not the pool's time per request,
  // which would keep the pool from the steps it wins until the next probe)
  if (eligible && !started) choice.Record(pooled, n, last_end_ns - last_start_ns);
  for (int64_t k = 0; k < n; ++k) {  // (a request writes a message only with these statuses)
    const int32_t kind = out3[k * 3] & ~kTerminated;
    if (kind == kFault || kind == kOverBudget) {
      errors.push_back(std::move(step_errors[k]));
      step_errors[k].clear();
    }
  }
}

bool FillChoice::UsePool() {
  probing = false;
  if (!adaptive || pool_steps < kWarmSteps) return true;
  if (alone_steps < kWarmSteps) return false;
  const bool pool_wins = pool_ns <= alone_ns;
  if (++since_probe < probe_every) return pool_wins;
  since_probe = 0;
  probing = true;
  return !pool_wins;
}

void FillChoice::Record(bool pooled, int64_t n, int64_t ns) {
  const double x = static_cast<double>(ns) / static_cast<double>(n);
  double& average = pooled ? pool_ns : alone_ns;
  int64_t& steps = pooled ? pool_steps : alone_steps;
  // (a warm-up step, or a probe's side, which has not run for a while: its time replaces the
  // average)
  average = steps < kWarmSteps || probing ? x : average + kWeight * (x - average);
  ++steps;
  if (probing) {
    probe_every = pool_ns <= alone_ns ? kProbeMin : std::min(probe_every * 2, kProbeMax);
    probing = false;
  }
}

void Builder::SetFill(int64_t threads, int64_t min_requests, bool adaptive) {
  if (threads < 1 || threads > kMaxFillThreads || min_requests < 1) {
    TVM_FFI_THROW(ValueError) << "host build: fill threads " << threads << " (expected 1 to "
                              << kMaxFillThreads << ") or pool_min_requests " << min_requests
                              << " (expected >= 1)";
  }
  std::lock_guard<std::mutex> hold(pool_mu_);
  fill_threads = threads;
  pool_min_requests = min_requests;
  choice = FillChoice();
  choice.adaptive = adaptive;
  if (pool_ != nullptr && pool_->size() > threads - 1) ClosePoolLocked();
}

void Builder::ClosePool() {
  std::lock_guard<std::mutex> hold(pool_mu_);
  ClosePoolLocked();
}

void Builder::ClosePoolLocked() {
  if (pool_ == nullptr) return;
  if (pool_->pid() != getpid()) {
    (void)pool_.release();  // a forked child: the parent's threads are not here to join
    return;
  }
  pool_->Stop();
  pool_.reset();
}

// The Python side never hands in a step whose requests share a matcher or a row; a caller
// that did gets the one-thread result.
bool Builder::Disjoint(std::vector<std::pair<const void*, int64_t>>* matchers,
              std::vector<std::pair<int64_t, int64_t>>* spans) {
  std::sort(matchers->begin(), matchers->end());
  for (size_t k = 1; k < matchers->size(); ++k) {
    if ((*matchers)[k].first == (*matchers)[k - 1].first) return false;
  }
  std::sort(spans->begin(), spans->end());
  for (size_t k = 1; k < spans->size(); ++k) {
    if ((*spans)[k].first <= (*spans)[k - 1].second) return false;
  }
  return true;
}

// One step over n requests. tokens[k] < 0: the matcher was created this step (fill only).
int64_t Builder::Step(const Array<ObjectRef>& matchers, const Array<int64_t>& tokens,
                      const Array<int64_t>& offsets, const Array<int64_t>& num_drafts,
                      const Array<int64_t>& drafts, int64_t draft_len, int64_t clear_rows) {
  const int64_t n = static_cast<int64_t>(matchers.size());
  if (static_cast<int64_t>(tokens.size()) != n || static_cast<int64_t>(offsets.size()) != n ||
      (num_drafts.size() != 0 && static_cast<int64_t>(num_drafts.size()) != n)) {
    TVM_FFI_THROW(ValueError) << "host build: column lengths differ (" << n << " matchers, "
                              << tokens.size() << " tokens, " << offsets.size()
                              << " offsets, " << num_drafts.size() << " draft counts)";
  }
  if (n > out.size(0)) {
    TVM_FFI_THROW(ValueError) << "host build: " << n << " requests exceed the "
                              << out.size(0) << " output rows";
  }
  int32_t* o = static_cast<int32_t*>(out.data_ptr());
  int32_t* mask = BeginStep(clear_rows);
  const int64_t rows = bitmask.size(0);
  draft_starts_.resize(n);
  int64_t draft_pos = 0;
  for (int64_t k = 0; k < n; ++k) {
    draft_starts_[k] = draft_pos;
    draft_pos += num_drafts.size() ? num_drafts[k] : 0;
  }
  bool parallel = fill_threads > 1 && n >= pool_min_requests;
  if (parallel) {
    std::vector<std::pair<const void*, int64_t>> keys(n);
    std::vector<std::pair<int64_t, int64_t>> spans(n);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t nd = num_drafts.size() ? num_drafts[k] : 0;
      keys[k] = {matchers[k].get(), k};
      spans[k] = {offsets[k], offsets[k] + std::min(nd, draft_len)};
    }
    parallel = Disjoint(&keys, &spans);
  }
  const int64_t* starts = draft_starts_.data();
  ForEachRequest(n, o, parallel,
                 [&](int64_t k, StepClock* clock, std::string* error) {
                   const int64_t nd = num_drafts.size() ? num_drafts[k] : 0;
                   RunOne(matchers[k], tokens[k], offsets[k], nd,
                          Drafts{nullptr, &drafts, starts[k]}, draft_len, rows, mask,
                          o + k * 3, clock, error);
                 });
  int64_t unusual = 0;
  for (int64_t k = 0; k < n; ++k) unusual += o[k * 3] != kOk;
  return unusual;
}

}  // namespace capgraph

namespace {

using capgraph::Builder;
using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::ObjectRef;
using tvm::ffi::String;
using tvm::ffi::Tensor;

void CheckInt32(const Tensor& t, int ndim, const char* what) {
  const DLDataType dt = t.dtype();
  if (t.ndim() != ndim || dt.code != kDLInt || dt.bits != 32 || dt.lanes != 1 ||
      t.device().device_type != kDLCPU) {
    TVM_FFI_THROW(TypeError) << "host build: " << what << " must be a " << ndim
                             << "-D int32 CPU tensor";
  }
  if (!t.IsContiguous()) {  // the loop indexes rows as flat arrays
    TVM_FFI_THROW(ValueError) << "host build: " << what << " must be contiguous";
  }
}

// make_builder(accept, fill, is_terminated, bitmask, token_mask, out, stop_ids, full_words,
//              tail_mask, clear_word, clear_keep)
//   -> [step, errors, address, set_budget, set_fill, close_pool, last_step, set_utf8]
//   step(matchers, tokens, offsets, num_drafts, drafts, draft_len, clear_rows)
//     -> how many requests are not plainly OK; token_mask[:clear_rows] is zeroed first
//   errors() -> the messages of the last step's faults and the milliseconds measured for its
//     over-budget requests (as text), in request order
//   address: the Builder's address for python_entry.cc's make_fast (kept alive by step)
//   set_budget(ns): one request's host-step budget from the next step on (0: none)
//   set_fill(threads, min_requests, adaptive): the fill's threads in all (1: the calling
//     thread only), the fewest requests a step needs to use more than one, and whether the
//     pool runs only where it has been faster (FillChoice; Builder::SetFill)
//   close_pool(): end the fill threads (a later step of min_requests starts them again)
//   set_utf8(trans, allowed): the UTF-8 guard's tables (Builder::utf8_trans); from then on a
//     matcher with a registered guard (utf8_guard_new) is guarded: a token whose bytes are
//     not UTF-8 after its text is refused, and each row it fills is ANDed with the tokens
//     that are
//   last_step() -> [threads, pool requests, start ns, end ns] of the last step's requests
//     (how many threads ran them, the caller included; how many the pool's threads ran;
//     the monotonic clock of std::chrono::steady_clock, CLOCK_MONOTONIC on Linux)
Array<Any> MakeBuilder(Function accept, Function fill, Function is_terminated, Tensor bitmask,
                       Tensor token_mask, Tensor out, Array<int64_t> stop_ids,
                       int64_t full_words, int64_t tail_mask, int64_t clear_word,
                       int64_t clear_keep) {
  CheckInt32(bitmask, 2, "bitmask");
  CheckInt32(token_mask, 1, "token_mask");
  CheckInt32(out, 2, "out");
  if (out.size(1) != 3) TVM_FFI_THROW(ValueError) << "host build: out must be [n, 3]";
  if (token_mask.size(0) < bitmask.size(0)) {
    TVM_FFI_THROW(ValueError) << "host build: token_mask has fewer rows than the bitmask";
  }
  auto b = std::make_shared<Builder>();
  b->accept = std::move(accept);
  b->fill = std::move(fill);
  b->is_terminated = std::move(is_terminated);
  b->words = bitmask.size(1);
  if (full_words < 0 || full_words > b->words || (tail_mask && full_words >= b->words)) {
    TVM_FFI_THROW(ValueError) << "host build: full_words " << full_words
                              << " does not fit a row of " << b->words << " words";
  }
  if (clear_word >= b->words) {
    TVM_FFI_THROW(ValueError) << "host build: clear_word " << clear_word
                              << " is outside a row of " << b->words << " words";
  }
  b->bitmask = std::move(bitmask);
  b->token_mask = std::move(token_mask);
  b->out = std::move(out);
  for (int64_t s : stop_ids) b->stop_ids.push_back(s);
  b->full_words = full_words;
  b->tail_mask = static_cast<uint32_t>(tail_mask);
  b->clear_word = clear_word;
  b->clear_keep = static_cast<uint32_t>(clear_keep);
  Function step = Function::FromTyped(
      [b](Array<ObjectRef> matchers, Array<int64_t> tokens, Array<int64_t> offsets,
          Array<int64_t> num_drafts, Array<int64_t> drafts, int64_t draft_len,
          int64_t clear_rows) -> int64_t {
        return b->Step(matchers, tokens, offsets, num_drafts, drafts, draft_len, clear_rows);
      });
  Function errors = Function::FromTyped([b]() -> Array<String> {
    Array<String> result;
    for (const std::string& e : b->errors) result.push_back(String(e));
    return result;
  });
  Function set_budget = Function::FromTyped([b](int64_t budget_ns) -> void {
    if (budget_ns < 0) {
      TVM_FFI_THROW(ValueError) << "host build: budget " << budget_ns << " ns is negative";
    }
    b->budget_ns = budget_ns;
  });
  Function set_fill = Function::FromTyped(
      [b](int64_t threads, int64_t min_requests, bool adaptive) -> void {
        b->SetFill(threads, min_requests, adaptive);
      });
  Function close_pool = Function::FromTyped([b]() -> void { b->ClosePool(); });
  Function set_utf8 = Function::FromTyped([b](Tensor trans, Tensor allowed) -> void {
    if (trans.ndim() != 2 || trans.size(0) != capgraph::kUtf8States ||
        trans.dtype().code != kDLUInt || trans.dtype().bits != 8 || !trans.IsContiguous() ||
        trans.device().device_type != kDLCPU) {
      TVM_FFI_THROW(ValueError) << "host build: the UTF-8 transitions must be a contiguous CPU "
                                << "uint8 [" << capgraph::kUtf8States << ", vocab] tensor";
    }
    CheckInt32(allowed, 2, "utf8 allowed");
    if (allowed.size(0) != capgraph::kUtf8States + 1 || allowed.size(1) != b->words) {
      TVM_FFI_THROW(ValueError) << "host build: the UTF-8 allowed masks must be ["
                                << capgraph::kUtf8States + 1 << ", " << b->words << "]";
    }
    b->utf8_vocab = trans.size(1);
    b->utf8_start_words.clear();
    b->utf8_start_masks.clear();
    const int32_t* start = static_cast<const int32_t*>(allowed.data_ptr());
    for (int64_t w = 0; w < b->words; ++w) {
      if (start[w] != -1) {
        b->utf8_start_words.push_back(w);
        b->utf8_start_masks.push_back(start[w]);
      }
    }
    b->utf8_allowed = std::move(allowed);
    b->utf8_trans = std::move(trans);
  });
  Function last_step = Function::FromTyped([b]() -> Array<int64_t> {
    return Array<int64_t>{b->last_threads, b->last_pool_requests, b->last_start_ns,
                          b->last_end_ns};
  });
  const int64_t address = static_cast<int64_t>(reinterpret_cast<intptr_t>(b.get()));
  return Array<Any>{step, errors, address, set_budget, set_fill, close_pool, last_step,
                    set_utf8};
}

// utf8_guard_new(object) -> [guard, data]: a UTF-8 guard registered for the matcher FFI object
// at `object` (replacing any earlier one there), counted once for the registry and once for
// the caller; `data` is its GUARD_BYTES of state (capgraph/grammar/utf8.py's layout).
Array<int64_t> Utf8GuardNew(int64_t object) {
  if (object == 0) TVM_FFI_THROW(ValueError) << "utf8_guard_new: null object";
  capgraph::Utf8Guard* g = capgraph::NewGuard(reinterpret_cast<const void*>(object));
  return Array<int64_t>{static_cast<int64_t>(reinterpret_cast<intptr_t>(g)),
                        static_cast<int64_t>(reinterpret_cast<intptr_t>(g->data))};
}

// utf8_guard_drop(object, guard): the caller's count of `guard` released, and the registry's
// where it still holds it for `object`.
void Utf8GuardDrop(int64_t object, int64_t guard) {
  capgraph::DropGuard(reinterpret_cast<const void*>(object),
                      reinterpret_cast<capgraph::Utf8Guard*>(guard));
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_builder, MakeBuilder);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(utf8_guard_new, Utf8GuardNew);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(utf8_guard_drop, Utf8GuardDrop);

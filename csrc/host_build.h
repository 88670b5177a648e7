// capgraph host build: what the build loop (builder.cc) and its CPython entry
// (python_entry.cc) share -- the Builder that runs GuidedDecoder.build's every-step loop over
// xgrammar's matchers, the per-request status codes it reports, and the clocks its host-step
// budget reads.
//
// The matchers are xgrammar's FFI objects and their methods are tvm-ffi Functions handed in
// from Python, so the library needs only tvm-ffi's headers (xgrammar ships none), and a test
// can hand in wrapped methods that fail on purpose. Compiled at run time by capgraph/jit.py
// (for capgraph/build/library.py), never at import.

#ifndef CAPGRAPH_HOST_BUILD_H_
#define CAPGRAPH_HOST_BUILD_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <time.h>  // clock_gettime(CLOCK_THREAD_CPUTIME_ID)

namespace capgraph {

using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::ObjectRef;
using tvm::ffi::Tensor;

// The monotonic clock (vDSO, ~20 ns a read) that the host-step budget is measured on.
inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// This thread's CPU time (a system call, ~0.4 us): read at most once per quarter budget of
// wall time and once per overrun (Builder::OverBudget).
inline int64_t ThreadCpuNs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Status of one request after a step (out[k * 3 + 0]); out[k * 3 + 1] = tokens accepted,
// out[k * 3 + 2] = rows guided. kTerminated is a flag added to any status. The same values
// are capgraph/build/library.py's STATUS_* and TERMINATED.
constexpr int32_t kOk = 0;
constexpr int32_t kRejected = 1;  // the new token was not allowed (nothing filled)
constexpr int32_t kDeadEnd = 2;   // the first row allows no token
constexpr int32_t kFault = 3;     // a matcher call raised; see errors()
constexpr int32_t kOverBudget = 4;  // over the host-step budget; errors() holds the ms measured
constexpr int32_t kTerminated = 8;

// A matcher's UTF-8 guard (capgraph/grammar/utf8.py, whose layout `data` is): an int64 count
// of the tokens accepted, an int64 floor (the lowest count whose state the ring still holds),
// then a ring of kUtf8Ring states, the state after each of the last ones (0: at a character
// boundary; 1..7: inside a character). Python's matcher wrapper and the builds below share
// it: utf8_guard_new registers one for a matcher's FFI object, and a build looks it up by
// that object (GuardRef), counted so that it outlives every use.
constexpr int64_t kUtf8Ring = 1016;
constexpr int64_t kUtf8Head = 16;  // the count and the floor
constexpr int64_t kUtf8States = 8;
constexpr uint8_t kUtf8Invalid = 8;  // a token whose bytes are not UTF-8 from the state

struct Utf8Guard {
  std::atomic<int64_t> refs{0};
  alignas(8) uint8_t data[kUtf8Head + kUtf8Ring] = {};

  int64_t Count() const { return Head(0); }
  int64_t Floor() const { return Head(1); }
  uint8_t State() const {
    const int64_t c = Count();
    return c <= 0 ? 0 : data[kUtf8Head + (c - 1) % kUtf8Ring];
  }
  void Push(uint8_t state) {
    const int64_t c = Count() + 1;
    data[kUtf8Head + (c - 1) % kUtf8Ring] = state;
    SetHead(0, c);
    // (the state of count c - kUtf8Ring sat where this one went)
    if (c - (kUtf8Ring - 1) > Floor()) SetHead(1, c - (kUtf8Ring - 1));
  }
  // Forget the last n tokens; false (nothing changed) where that goes back past the oldest
  // state the ring holds (in one rollback or several) or past the first token.
  bool Pop(int64_t n) {
    const int64_t c = Count();
    if (n < 0 || c - n < Floor()) return false;
    SetHead(0, c - n);
    return true;
  }
  // Undo a Pop(n) (the matcher's own rollback failed: it did not move).
  void Unpop(int64_t n) { SetHead(0, Count() + n); }

 private:
  int64_t Head(int i) const {
    int64_t v;
    std::memcpy(&v, data + 8 * i, sizeof(v));
    return v;
  }
  void SetHead(int i, int64_t v) { std::memcpy(data + 8 * i, &v, sizeof(v)); }
};

// A counted reference to the guard registered for a matcher's FFI object, or none.
class GuardRef {
 public:
  explicit GuardRef(const void* object);
  ~GuardRef();
  GuardRef(const GuardRef&) = delete;
  GuardRef& operator=(const GuardRef&) = delete;
  Utf8Guard* get() const { return guard_; }

 private:
  Utf8Guard* guard_ = nullptr;
};

// A new guard registered for `object` (counted for the registry and the caller), and the
// caller's count released (with the registry's, where it still holds this guard for it).
Utf8Guard* NewGuard(const void* object);
void DropGuard(const void* object, Utf8Guard* guard);

// The request fields the CPython entry (python_entry.cc) reads, by position: make_fast is
// handed their names in this order (capgraph/requests.py, NATIVE_RECORD_FIELDS, which the
// comments below quote); the names themselves live only in Python.
enum RecordField : int {
  kParams,           // guided_decoding_params: the guide object, or None (unguided)
  kSlot,             // seq_slot
  kToken,            // new_token
  kGenerating,       // is_generation_in_progress_state
  kIsDraft,          // is_draft
  kContext,          // is_context_init_state
  kDrafts,           // draft_tokens: a list of ints, or None
  kRequestId,        // request_id
  kFirstIteration,   // is_generation_only_first_iteration
  kDraftParents,     // draft_parents: None for a chain (a tree is built in Python)
  kPrevSlot,         // prev_seq_slot: None for a new request (the host node reads it)
  kLastChunk,        // is_last_context_chunk (the host node reads it)
  kAccepted,         // num_accepted_draft_tokens (the host node's settling of a rollback)
};
constexpr int kRecordFields = kAccepted + 1;

// One request's draft tokens: read from a plain array (the CPython entry) or from a tvm-ffi
// Array starting at `first` (the tvm-ffi step).
struct Drafts {
  const int64_t* data = nullptr;
  const Array<int64_t>* array = nullptr;
  int64_t first = 0;

  int64_t operator[](int64_t i) const {
    return array != nullptr ? (*array)[first + i] : data[i];
  }
};

class FillPool;

// Whether a step that may use the fill pool does: the pool and the calling thread alone each
// keep an average of their time per request over such steps, and the faster one runs the
// step. Each side first runs kWarmSteps steps in a row (the pool's first), whose times only
// seed its average, each replacing the one before: a side's first steps on a thread pay
// one-time costs (the thread's first allocations and cache misses), and one such step would
// otherwise decide the choice until the next probe. A step that starts pool threads is not
// recorded at all. Then now and then the other side runs a step instead (a probe, whose time
// replaces that side's average): every kProbeMin-th step while the pool wins; while it loses,
// the interval doubles with each lost probe, up to kProbeMax. Where other work keeps the
// cores busy, a pool thread waits to be scheduled and the pool loses: it then costs one probe
// step in kProbeMax. `adaptive` false: the pool runs every such step (to measure it).
struct FillChoice {
  static constexpr int64_t kProbeMin = 16, kProbeMax = 256, kWarmSteps = 2;
  static constexpr double kWeight = 0.25;  // of a step in its side's average
  bool adaptive = true;
  double pool_ns = 0, alone_ns = 0;  // per request (meaningful once the side has a step)
  int64_t pool_steps = 0, alone_steps = 0;  // recorded steps per side
  int64_t since_probe = 0, probe_every = kProbeMin;
  bool probing = false;  // the step being run is a probe

  bool UsePool();
  void Record(bool pooled, int64_t n, int64_t ns);
};

// One decoder's build loop, bound to its host bitmask, token mask and output rows
// (make_builder in builder.cc creates it; the CPython entry reaches it by address).
//
// A step's requests are independent: each writes only its own {status, accepted, guided}
// triplet, its own rows and token-mask entries and its own error message, and runs its own
// matcher (no two requests of a step share one). RunEntries splits them across a pool of
// fill threads and the calling thread from `pool_min_requests` requests on, where the pool
// has been the faster lately (FillChoice); the results are the same as one thread's, in
// request order.
struct Builder {
  Function accept, fill, is_terminated;
  Tensor bitmask, token_mask, out;
  // the UTF-8 guard's tables (set_utf8; undefined: no guard): per state and token the state
  // after the token (uint8 [kUtf8States, utf8_vocab]), and per state (and kUtf8Invalid) the
  // tokens allowed from it (int32 [kUtf8States + 1, words])
  Tensor utf8_trans, utf8_allowed;
  int64_t utf8_vocab = 0;
  // the words of the start state's row (at a character boundary) that refuse some token,
  // and their masks: there only these are ANDed (a few hundred of a row's thousands)
  std::vector<int64_t> utf8_start_words;
  std::vector<int32_t> utf8_start_masks;
  std::vector<int64_t> stop_ids;
  int64_t words = 0;        // int32 words per bitmask row
  int64_t full_words = 0;   // words wholly below vocab_size_padded
  uint32_t tail_mask = 0;   // bits of word full_words below vocab_size_padded (0: none)
  int64_t clear_word = -1;  // first word holding ids >= the tokenizer's vocabulary (-1: none)
  uint32_t clear_keep = 0;  // bits of clear_word below the tokenizer's vocabulary
  int64_t budget_ns = 0;    // one request's host step may take this long (0: no budget)
  // the last step's fault messages and over-budget milliseconds, in request order
  std::vector<std::string> errors;
  // the fill: this many threads in all (the calling thread and fill_threads - 1 pool
  // threads) for a step of at least pool_min_requests requests; one thread below
  int64_t fill_threads = 1;
  int64_t pool_min_requests = 1;
  FillChoice choice;
  // the last RunEntries: threads that ran requests (the caller included), requests the pool
  // threads ran, and its start and end on the monotonic clock (NowNs)
  int64_t last_threads = 0, last_pool_requests = 0, last_start_ns = 0, last_end_ns = 0;

  Builder();
  ~Builder();  // joins the pool's threads (in a forked child, leaves the parent's alone)
  Builder(const Builder&) = delete;
  Builder& operator=(const Builder&) = delete;

  // The host-step budget's clock over one step on one thread: a request's wall time runs
  // from the end of the one before it (one clock read per request); an overrun must also
  // show in this thread's CPU time, so that time spent waiting (preempted, at nice 19 behind
  // the caller's threads, for the GIL) is not blamed on a request (OverBudget).
  struct StepClock {
    struct Anchor {       // this thread's (OverBudget), kept from step to step:
      int64_t wall = 0;   // a request's start, wall ns,
      int64_t cpu = 0;    // and the thread's CPU ns then
    };
    int64_t last = 0;     // wall ns at the end of the previous request (or the step's start)
    Anchor* anchor = nullptr;
  };

  // This thread's clock for a step, or nullptr without a budget.
  StepClock* StartClock(StepClock* clock) const;

  // Whether the request that ends now went over the budget (reads the clock, moves it on):
  // its wall time and the CPU time it used on this thread are both over it (a thread that
  // was preempted, or waited for the GIL, did not spend the budget); its wall milliseconds
  // in *ms.
  bool OverBudget(StepClock* clock, double* ms) const;

  // One request: accept `token` (< 0: none, the matcher was created this step), fill its
  // rows from `offset`, then follow its `nd` drafts. Writes {status, accepted, guided} to o3;
  // a fault's message or the over-budget milliseconds to *error. Touches no Python object
  // and nothing another request writes (any thread, several at once).
  void RunOne(const ObjectRef& m, int64_t token, int64_t offset, int64_t nd, Drafts drafts,
              int64_t draft_len, int64_t rows, int32_t* mask, int32_t* o3, StepClock* clock,
              std::string* error) const;

  // RunOne on one thread at a time, its message (if any) appended to `errors`.
  void RunOne(const ObjectRef& m, int64_t token, int64_t offset, int64_t nd, Drafts drafts,
              int64_t draft_len, int64_t rows, int32_t* mask, int32_t* o3, StepClock* clock) {
    std::string error;
    RunOne(m, token, offset, nd, drafts, draft_len, rows, mask, o3, clock, &error);
    if (!error.empty()) errors.push_back(std::move(error));
  }

  // Request k of a step: run it (RunOne) with this thread's clock, its message in *error.
  using EntryFn = void (*)(const void* context, int64_t k, StepClock* clock,
                           std::string* error);

  // Run requests [0, n) of a step, each once: entry(context, k, ...) writes out3[k * 3 ...].
  // On the pool's threads and the calling thread where `parallel`, n reaches
  // pool_min_requests and `choice` picks the pool (each thread with its own budget clock: a
  // request's time runs from the end of the one before it on the same thread), else in order
  // on the calling thread. Then appends the messages of the faulted and over-budget
  // requests to `errors`, in request order. Never takes the GIL; what a matcher method
  // throws is its request's fault (RunOne).
  void RunEntries(int64_t n, const int32_t* out3, bool parallel, const void* context,
                  EntryFn entry);

  // RunEntries with a callable entry(k, clock, error).
  template <class F>
  void ForEachRequest(int64_t n, const int32_t* out3, bool parallel, const F& entry) {
    RunEntries(n, out3, parallel, &entry,
               [](const void* c, int64_t k, StepClock* clock, std::string* error) {
                 (*static_cast<const F*>(c))(k, clock, error);
               });
  }

  // Set the fill's thread count, threshold and whether `choice` adapts (ValueError: threads
  // < 1 or > kMaxFillThreads, min_requests < 1); its averages start again. A pool larger than
  // now needed is ended (a later step starts another).
  void SetFill(int64_t threads, int64_t min_requests, bool adaptive);

  // End the pool's threads (a parked pool: at once); a later parallel step starts new ones.
  void ClosePool();

  // Zero token_mask[:clear_rows] (the step's layout rows start unmasked) and the errors;
  // returns the token mask. Throws a tvm-ffi ValueError for clear_rows outside the bitmask.
  int32_t* BeginStep(int64_t clear_rows);

  // One step over n requests (the tvm-ffi step); how many are not plainly OK.
  int64_t Step(const Array<ObjectRef>& matchers, const Array<int64_t>& tokens,
               const Array<int64_t>& offsets, const Array<int64_t>& num_drafts,
               const Array<int64_t>& drafts, int64_t draft_len, int64_t clear_rows);

  // Whether no two of a step's requests share a matcher (matchers: {address, k}) or a row
  // (spans: request k's rows [first, last]); only then may they run on several threads.
  // Sorts both.
  static bool Disjoint(std::vector<std::pair<const void*, int64_t>>* matchers,
                       std::vector<std::pair<int64_t, int64_t>>* spans);

  static constexpr int64_t kMaxFillThreads = 256;

 private:
  std::unique_ptr<FillPool> pool_;  // started by the first parallel step
  // held by a step for its run and by ClosePool / SetFill: the pool is never ended under a
  // step that runs on it (a caller's close waits for the step)
  std::mutex pool_mu_;
  void ClosePoolLocked();
  std::vector<std::string> entry_errors_;  // per request of the step being run
  std::vector<int64_t> draft_starts_;  // Step: where request k's drafts start

  bool IsStop(int64_t token) const;
  int32_t* Row(int64_t row) const;
  void ClearTail(int64_t row) const;
  bool HasValidToken(int64_t row) const;
  bool Accept(const ObjectRef& m, int64_t token, bool* terminated, Utf8Guard* guard) const;

 public:
  // The state after `token` from the guard's (kUtf8Invalid: refused).
  uint8_t Utf8Next(const Utf8Guard& guard, int64_t token) const;
  // AND the row with the tokens allowed from the guard's state.
  void Utf8Mask(int64_t row, const Utf8Guard& guard) const;
};

}  // namespace capgraph

#endif  // CAPGRAPH_HOST_BUILD_H_

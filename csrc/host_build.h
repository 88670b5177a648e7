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

#include <chrono>
#include <cstdint>
#include <string>
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

// This thread's CPU time (a system call, ~0.4 us): read only on the build thread, where the
// wall clock also counts the time the thread waits at nice 19 behind the caller's threads.
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
};
constexpr int kRecordFields = kPrevSlot + 1;

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

// One decoder's build loop, bound to its host bitmask, token mask and output rows
// (make_builder in builder.cc creates it; the CPython entry reaches it by address).
struct Builder {
  Function accept, fill, is_terminated;
  Tensor bitmask, token_mask, out;
  std::vector<int64_t> stop_ids;
  int64_t words = 0;        // int32 words per bitmask row
  int64_t full_words = 0;   // words wholly below vocab_size_padded
  uint32_t tail_mask = 0;   // bits of word full_words below vocab_size_padded (0: none)
  int64_t clear_word = -1;  // first word holding ids >= the tokenizer's vocabulary (-1: none)
  uint32_t clear_keep = 0;  // bits of clear_word below the tokenizer's vocabulary
  int64_t budget_ns = 0;    // one request's host step may take this long (0: no budget)
  std::vector<std::string> errors;

  // The host-step budget's clock over one step: a request's wall time runs from the end of
  // the one before it (one clock read per request). On the build thread (`cpu0` >= 0) an
  // overrun must also show in this thread's CPU time, so that time spent waiting at nice 19
  // behind the caller's threads is not blamed on a request.
  struct StepClock {
    int64_t last = 0;   // wall ns at the end of the previous request (or the step's start)
    int64_t wall0 = 0;  // the step's start: wall ns,
    int64_t cpu0 = -1;  // and this thread's CPU ns (-1: not read; the calling thread)
  };

  // The step's clock, or nullptr without a budget.
  StepClock* StartClock(StepClock* clock, bool cpu_time) const;

  // Whether the request that ends now went over the budget (reads the clock, moves it on);
  // its wall milliseconds in *ms.
  bool OverBudget(StepClock* clock, double* ms) const;

  // One request: accept `token` (< 0: none, the matcher was created this step), fill its
  // rows from `offset`, then follow its `nd` drafts. Writes {status, accepted, guided} to o3;
  // a fault's message is appended to `errors`. Touches no Python object (any thread).
  void RunOne(const ObjectRef& m, int64_t token, int64_t offset, int64_t nd, Drafts drafts,
              int64_t draft_len, int64_t rows, int32_t* mask, int32_t* o3, StepClock* clock);

  // Zero token_mask[:clear_rows] (the step's layout rows start unmasked) and the errors;
  // returns the token mask. Throws a tvm-ffi ValueError for clear_rows outside the bitmask.
  int32_t* BeginStep(int64_t clear_rows);

  // One step over n requests (the tvm-ffi step); how many are not plainly OK.
  int64_t Step(const Array<ObjectRef>& matchers, const Array<int64_t>& tokens,
               const Array<int64_t>& offsets, const Array<int64_t>& num_drafts,
               const Array<int64_t>& drafts, int64_t draft_len, int64_t clear_rows);

 private:
  bool IsStop(int64_t token) const;
  int32_t* Row(int64_t row) const;
  void ClearTail(int64_t row) const;
  bool HasValidToken(int64_t row) const;
  bool Accept(const ObjectRef& m, int64_t token, bool* terminated) const;
};

}  // namespace capgraph

#endif  // CAPGRAPH_HOST_BUILD_H_

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

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

namespace capgraph {

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

// Accept one token; sets *terminated when it was a stop token that ended the grammar.
bool Builder::Accept(const ObjectRef& m, int64_t token, bool* terminated) const {
  bool ok = accept(m, token, false).cast<bool>();
  if (ok && IsStop(token)) *terminated = is_terminated(m).cast<bool>();
  return ok;
}

// The step's clock, or nullptr without a budget.
Builder::StepClock* Builder::StartClock(StepClock* clock, bool cpu_time) const {
  if (!budget_ns) return nullptr;
  clock->last = clock->wall0 = NowNs();
  if (cpu_time) clock->cpu0 = ThreadCpuNs();
  return clock;
}

// Whether the request that ends now went over the budget (reads the clock, moves it on);
// its wall milliseconds in *ms.
bool Builder::OverBudget(StepClock* clock, double* ms) const {
  const int64_t now = NowNs();
  const int64_t start = clock->last;
  clock->last = now;
  if (now - start <= budget_ns) return false;
  *ms = static_cast<double>(now - start) / 1e6;
  if (clock->cpu0 < 0) return true;
  // the CPU this request used is at least the step's CPU so far less the wall time that
  // went to the requests before it
  const int64_t cpu = ThreadCpuNs() - clock->cpu0 - (start - clock->wall0);
  return cpu > budget_ns;
}

// One request: accept `token` (< 0: none, the matcher was created this step), fill its
// rows from `offset`, then follow its `nd` drafts (drafts[i] is the i-th). Writes
// {status, accepted, guided} to o3; a fault's message is appended to `errors`.
//
// With a budget (`clock`), a request that would otherwise be plainly OK and took longer
// ends with kOverBudget: its rows unmasked, its counts zero (Python drops its matcher), the
// milliseconds measured appended to `errors`. It is measured once, at its end: xgrammar's
// calls cannot be interrupted, and one clock read per request keeps the common step's cost
// within noise, so a slow request costs at most its own rows' calls, in one step.
void Builder::RunOne(const ObjectRef& m, int64_t token, int64_t offset, int64_t nd,
                     Drafts drafts, int64_t draft_len, int64_t rows, int32_t* mask, int32_t* o3,
                     StepClock* clock) {
  int32_t status = kOk;
  int32_t accepted = 0, guided = 0;
  bool terminated = false;
  try {
    bool go = true;
    if (token >= 0) {
      if (!Accept(m, token, &terminated)) {
        status = kRejected;
        go = false;
      } else {
        ++accepted;
        go = !terminated;
      }
    }
    for (int64_t i = 0; go; ++i) {
      const int64_t row = offset + i;
      if (row < 0 || row >= rows) {
        TVM_FFI_THROW(IndexError) << "host build: row " << row << " is outside the " << rows
                                  << "-row bitmask";
      }
      fill(m, bitmask, row, false);
      ClearTail(row);
      if (!HasValidToken(row)) {
        if (i == 0) status = kDeadEnd;
        break;  // a dead draft position stays unguided (as PythonBuild: no status)
      }
      ++guided;
      mask[row] = 1;
      if (i >= draft_len || i >= nd) break;
      if (!Accept(m, drafts[i], &terminated)) break;  // the draft left the grammar
      ++accepted;
      if (terminated) break;
    }
  } catch (const tvm::ffi::Error& e) {
    status = kFault;
    errors.push_back(e.kind() + ": " + e.message());
  } catch (const std::exception& e) {
    status = kFault;
    errors.push_back(std::string("RuntimeError: ") + e.what());
  }
  double ms = 0;
  if (clock != nullptr && OverBudget(clock, &ms) && status == kOk) {
    for (int64_t r = offset; r < offset + guided; ++r) mask[r] = 0;  // (the guided rows)
    status = kOverBudget;
    accepted = guided = 0;
    terminated = false;  // (its matcher is dropped)
    errors.push_back(std::to_string(ms));
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
  int64_t unusual = 0;
  int64_t draft_pos = 0;
  StepClock clock_state;
  StepClock* clock = StartClock(&clock_state, false);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t nd = num_drafts.size() ? num_drafts[k] : 0;
    const int64_t first_draft = draft_pos;
    draft_pos += nd;
    RunOne(matchers[k], tokens[k], offsets[k], nd, Drafts{nullptr, &drafts, first_draft},
           draft_len, rows, mask, o + k * 3, clock);
    if (o[k * 3] != kOk) ++unusual;
  }
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
//              tail_mask, clear_word, clear_keep) -> [step, errors, address, set_budget]
//   step(matchers, tokens, offsets, num_drafts, drafts, draft_len, clear_rows)
//     -> how many requests are not plainly OK; token_mask[:clear_rows] is zeroed first
//   errors() -> the messages of the last step's faults and the milliseconds measured for its
//     over-budget requests (as text), in request order
//   address: the Builder's address for python_entry.cc's make_fast (kept alive by step)
//   set_budget(ns): one request's host-step budget from the next step on (0: none)
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
  const int64_t address = static_cast<int64_t>(reinterpret_cast<intptr_t>(b.get()));
  return Array<Any>{step, errors, address, set_budget};
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_builder, MakeBuilder);

// capgraph host build: the every-step loop of GuidedDecoder.build in C++.
//
// Per guided request of a step: accept the new token, fill the request's first bitmask row,
// clear the padding ids, check the row for a dead end, mark it in the token mask; then for
// each draft token: accept it, fill the next row, and so on, stopping where the Python build
// (capgraph/decoder.py, _fill_sequential) stops. The matchers are xgrammar's FFI objects and
// their methods are called as tvm-ffi Functions handed in from Python, so this file needs
// only tvm-ffi's headers (xgrammar ships none), and a test can hand in wrapped methods that
// fail on purpose.
//
// What Python does around it: the request checks and bookkeeping (which requests take this
// path, their counters, failures, termination flags) stay in capgraph/decoder.py; this loop
// reports per request a status and how many tokens it accepted and rows it guided.
//
// The same library holds the CPU mask (apply_bitmask below): one pass over the logits where
// the torch code in capgraph/ops/torch_impl.py makes five.
//
// Compiled at run time by capgraph/grammar/native.py (a C++17 compiler and tvm-ffi's headers,
// cached on disk), never at import.

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::ObjectRef;
using tvm::ffi::String;
using tvm::ffi::Tensor;

// Status of one request after a step (out[k * 3 + 0]); out[k * 3 + 1] = tokens accepted,
// out[k * 3 + 2] = rows guided. kTerminated is a flag added to any status.
constexpr int32_t kOk = 0;
constexpr int32_t kRejected = 1;  // the new token was not allowed (nothing filled)
constexpr int32_t kDeadEnd = 2;   // the first row allows no token
constexpr int32_t kFault = 3;     // a matcher call raised; see errors()
constexpr int32_t kTerminated = 8;

struct Builder {
  Function accept, fill, is_terminated;
  Tensor bitmask, token_mask, out;
  std::vector<int64_t> stop_ids;
  int64_t words = 0;        // int32 words per bitmask row
  int64_t full_words = 0;   // words wholly below vocab_size_padded
  uint32_t tail_mask = 0;   // bits of word full_words below vocab_size_padded (0: none)
  int64_t clear_word = -1;  // first word holding ids >= the tokenizer's vocabulary (-1: none)
  uint32_t clear_keep = 0;  // bits of clear_word below the tokenizer's vocabulary
  std::vector<std::string> errors;

  bool IsStop(int64_t token) const {
    for (int64_t s : stop_ids) {
      if (s == token) return true;
    }
    return false;
  }

  int32_t* Row(int64_t row) const {
    return static_cast<int32_t*>(bitmask.data_ptr()) + row * words;
  }

  // Padding ids are never allowed (decoder._clear_tail).
  void ClearTail(int64_t row) const {
    if (clear_word < 0) return;
    int32_t* r = Row(row);
    int64_t w = clear_word;
    if (clear_keep) {
      r[w] = static_cast<int32_t>(static_cast<uint32_t>(r[w]) & clear_keep);
      ++w;
    }
    if (w < words) std::memset(r + w, 0, static_cast<size_t>(words - w) * sizeof(int32_t));
  }

  // True when the row allows some id below vocab_size_padded (decoder._dead_rows).
  bool HasValidToken(int64_t row) const {
    const int32_t* r = Row(row);
    for (int64_t w = 0; w < full_words; ++w) {
      if (r[w]) return true;
    }
    return tail_mask && (static_cast<uint32_t>(r[full_words]) & tail_mask);
  }

  // Accept one token; sets *terminated when it was a stop token that ended the grammar.
  bool Accept(const ObjectRef& m, int64_t token, bool* terminated) const {
    bool ok = accept(m, token, false).cast<bool>();
    if (ok && IsStop(token)) *terminated = is_terminated(m).cast<bool>();
    return ok;
  }

  // One step over n requests. tokens[k] < 0: the matcher was created this step (fill only).
  int64_t Step(const Array<ObjectRef>& matchers, const Array<int64_t>& tokens,
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
    int32_t* mask = static_cast<int32_t*>(token_mask.data_ptr());
    const int64_t rows = bitmask.size(0);
    if (clear_rows < 0 || clear_rows > rows) {
      TVM_FFI_THROW(ValueError) << "host build: clear_rows " << clear_rows << " is outside [0, "
                                << rows << "]";
    }
    // the step's layout rows start unmasked; the loop marks the rows it guides
    std::memset(mask, 0, static_cast<size_t>(clear_rows) * sizeof(int32_t));
    errors.clear();
    int64_t unusual = 0;
    int64_t draft_pos = 0;
    for (int64_t k = 0; k < n; ++k) {
      const ObjectRef& m = matchers[k];
      const int64_t nd = num_drafts.size() ? num_drafts[k] : 0;
      const int64_t first_draft = draft_pos;
      draft_pos += nd;
      const int64_t offset = offsets[k];
      int32_t status = kOk;
      int32_t accepted = 0, guided = 0;
      bool terminated = false;
      try {
        const int64_t token = tokens[k];
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
            TVM_FFI_THROW(IndexError) << "host build: row " << row << " is outside the "
                                      << rows << "-row bitmask";
          }
          fill(m, bitmask, row, false);
          ClearTail(row);
          if (!HasValidToken(row)) {
            if (i == 0) status = kDeadEnd;
            break;  // a dead draft position stays unguided (decoder._dead_end)
          }
          ++guided;
          mask[row] = 1;
          if (i >= draft_len || i >= nd) break;
          const int64_t token_i = drafts[first_draft + i];
          if (!Accept(m, token_i, &terminated)) break;  // the draft left the grammar
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
      if (terminated) status |= kTerminated;
      if (status != kOk) ++unusual;
      o[k * 3 + 0] = status;
      o[k * 3 + 1] = accepted;
      o[k * 3 + 2] = guided;
    }
    return unusual;
  }
};

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
//              tail_mask, clear_word, clear_keep) -> [step, errors]
//   step(matchers, tokens, offsets, num_drafts, drafts, draft_len, clear_rows)
//     -> how many requests are not plainly OK; token_mask[:clear_rows] is zeroed first
//   errors() -> the messages of the last step's faults, in request order
Array<Function> MakeBuilder(Function accept, Function fill, Function is_terminated,
                            Tensor bitmask, Tensor token_mask, Tensor out,
                            Array<int64_t> stop_ids, int64_t full_words, int64_t tail_mask,
                            int64_t clear_word, int64_t clear_keep) {
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
  return Array<Function>{step, errors};
}

// apply_bitmask(logits, bitmask, token_mask, col_offset): the CPU mask in one pass.
//   logits [rows, W] float32/float16/bfloat16 (any row stride, unit column stride), bitmask
//   [>= rows, words] int32 (any row stride), token_mask [>= rows] int32 or None; column j of
//   a row reads bit col_offset + j. Disallowed entries become -inf; the rest keep their bits.
//   capgraph/ops/torch_impl.py checks the arguments (capgraph.ops.logits_bitmask) and calls
//   this for CPU tensors without d2t.
template <typename T>
void MaskRow(T* row, const int32_t* words, int64_t width, int64_t col_offset, T neg_inf) {
  if ((col_offset & 31) == 0) {  // word-aligned: whole words at a time
    const int32_t* w0 = words + (col_offset >> 5);
    const int64_t full = width >> 5;
    for (int64_t w = 0; w < full; ++w) {
      const uint32_t m = static_cast<uint32_t>(w0[w]);
      if (m == 0xFFFFFFFFu) continue;
      T* out = row + w * 32;
      if (m == 0) {
        for (int b = 0; b < 32; ++b) out[b] = neg_inf;
      } else {  // branch-free: a random word would mispredict a branch per bit
        for (int b = 0; b < 32; ++b) {
          const T keep = static_cast<T>(T(0) - static_cast<T>((m >> b) & 1u));
          out[b] = static_cast<T>((out[b] & keep) | (neg_inf & static_cast<T>(~keep)));
        }
      }
    }
    for (int64_t j = full * 32; j < width; ++j) {
      if (!((static_cast<uint32_t>(w0[j >> 5]) >> (j & 31)) & 1u)) row[j] = neg_inf;
    }
    return;
  }
  for (int64_t j = 0; j < width; ++j) {  // a shard starting inside a word
    const int64_t bit = col_offset + j;
    if (!((static_cast<uint32_t>(words[bit >> 5]) >> (bit & 31)) & 1u)) row[j] = neg_inf;
  }
}

template <typename T>
void MaskRows(const Tensor& logits, const Tensor& bitmask, const int32_t* token_mask,
              int64_t col_offset, T neg_inf) {
  const int64_t rows = logits.size(0), width = logits.size(1);
  const int64_t ls = logits.stride(0), bs = bitmask.stride(0);
  T* base = static_cast<T*>(logits.data_ptr());
  const int32_t* words = static_cast<const int32_t*>(bitmask.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    if (token_mask != nullptr && token_mask[r] == 0) continue;
    MaskRow<T>(base + r * ls, words + r * bs, width, col_offset, neg_inf);
  }
}

void ApplyBitmask(Tensor logits, Tensor bitmask, tvm::ffi::Optional<Tensor> token_mask,
                  int64_t col_offset) {
  if (logits.ndim() != 2 || bitmask.ndim() != 2 || logits.device().device_type != kDLCPU ||
      bitmask.device().device_type != kDLCPU) {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: 2-D CPU logits and bitmask expected";
  }
  const DLDataType bt = bitmask.dtype();
  if (bt.code != kDLInt || bt.bits != 32 || bitmask.stride(1) != 1 ||
      (logits.size(1) > 1 && logits.stride(1) != 1)) {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: int32 bitmask and unit column strides expected";
  }
  if (bitmask.size(0) < logits.size(0) || col_offset < 0 ||
      (col_offset + logits.size(1) + 31) / 32 > bitmask.size(1)) {
    TVM_FFI_THROW(ValueError) << "apply_bitmask: the bitmask does not cover the logits";
  }
  const int32_t* tm = nullptr;
  if (token_mask.has_value()) {
    const Tensor& t = token_mask.value();
    if (t.ndim() != 1 || t.dtype().code != kDLInt || t.dtype().bits != 32 ||
        t.device().device_type != kDLCPU || t.size(0) < logits.size(0) ||
        (t.size(0) > 1 && t.stride(0) != 1)) {
      TVM_FFI_THROW(TypeError) << "apply_bitmask: token_mask must be [>= rows] int32 on CPU";
    }
    tm = static_cast<const int32_t*>(t.data_ptr());
  }
  const DLDataType lt = logits.dtype();
  if (lt.code == kDLFloat && lt.bits == 32) {
    MaskRows<uint32_t>(logits, bitmask, tm, col_offset, 0xFF800000u);
  } else if (lt.code == kDLFloat && lt.bits == 16) {
    MaskRows<uint16_t>(logits, bitmask, tm, col_offset, 0xFC00u);
  } else if (lt.code == kDLBfloat && lt.bits == 16) {
    MaskRows<uint16_t>(logits, bitmask, tm, col_offset, 0xFF80u);
  } else {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: float32, float16 or bfloat16 logits expected";
  }
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(make_builder, MakeBuilder);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_bitmask, ApplyBitmask);

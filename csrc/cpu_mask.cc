// capgraph CPU mask: apply_bitmask, capgraph.ops.logits_bitmask's CPU kernel in one pass over
// the logits where the torch code in capgraph/ops/torch_impl.py makes five.
//
// An op of its own, independent of any grammar: a library of this file alone, compiled at run
// time by capgraph/jit.py against tvm-ffi's headers (for capgraph/ops/cpu_mask.py, cached on
// disk), never at import.

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <cstdint>

namespace {

using tvm::ffi::Tensor;

// apply_bitmask(logits, bitmask, token_mask, col_offset): the CPU mask in one pass.
//   logits [rows, W] float32/float16/bfloat16 (any row stride, unit column stride), bitmask
//   [>= rows, words] int32 (any row stride), token_mask [>= rows] int32 or None; column j of
//   a row reads bit col_offset + j. Disallowed entries become -inf; the rest keep their bits.
//   capgraph/ops/torch_impl.py checks the arguments (capgraph.ops.logits_bitmask) and calls
//   this for CPU tensors without d2t.
// apply_bitmask_indices(logits, bitmask, token_mask, col_offset, indices): the same over the
//   mask rows i < len(indices): bitmask row i and token_mask[i] mask logits row indices[i]
//   (indices dense int32 or int64, each in [0, rows), distinct: checked by the caller, which
//   reads them on the host; an index outside the logits is still skipped here, never written).
// The mask is bound by its stores: a fully disallowed word writes 32 -inf values, 8 stores of
// 16 bytes with the baseline x86-64 instruction set. MaskRowsWide below is compiled again for
// AVX2 and AVX-512 (GCC/Clang target_clones; the loader picks the clone this CPU runs), so
// the same source writes 64-byte vectors where the CPU has them. Inlined into each clone.
#define CAPGRAPH_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define CAPGRAPH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CAPGRAPH_CLONES
#endif

template <typename T>
CAPGRAPH_INLINE void MaskRow(T* row, const int32_t* words, int64_t width, int64_t col_offset,
                             T neg_inf) {
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

// The logits rows the mask rows stand for: row r itself, or indices[r] (int32 or int64).
struct RowIndex {
  const void* indices = nullptr;
  bool wide = false;  // int64 entries
  CAPGRAPH_INLINE int64_t operator()(int64_t r) const {
    if (indices == nullptr) return r;
    return wide ? static_cast<const int64_t*>(indices)[r]
                : static_cast<const int32_t*>(indices)[r];
  }
};

template <typename T>
CAPGRAPH_INLINE void MaskRows(const Tensor& logits, const Tensor& bitmask,
                              const int32_t* token_mask, int64_t col_offset, T neg_inf,
                              int64_t mask_rows, RowIndex row_of) {
  const int64_t rows = logits.size(0), width = logits.size(1);
  const int64_t ls = logits.stride(0), bs = bitmask.stride(0);
  T* base = static_cast<T*>(logits.data_ptr());
  const int32_t* words = static_cast<const int32_t*>(bitmask.data_ptr());
  for (int64_t r = 0; r < mask_rows; ++r) {
    if (token_mask != nullptr && token_mask[r] == 0) continue;
    const int64_t row = row_of(r);
    if (row < 0 || row >= rows) continue;
    MaskRow<T>(base + row * ls, words + r * bs, width, col_offset, neg_inf);
  }
}

CAPGRAPH_CLONES void MaskRowsWide32(const Tensor& logits, const Tensor& bitmask,
                                    const int32_t* token_mask, int64_t col_offset,
                                    uint32_t neg_inf, int64_t mask_rows, RowIndex row_of) {
  MaskRows<uint32_t>(logits, bitmask, token_mask, col_offset, neg_inf, mask_rows, row_of);
}

CAPGRAPH_CLONES void MaskRowsWide16(const Tensor& logits, const Tensor& bitmask,
                                    const int32_t* token_mask, int64_t col_offset,
                                    uint16_t neg_inf, int64_t mask_rows, RowIndex row_of) {
  MaskRows<uint16_t>(logits, bitmask, token_mask, col_offset, neg_inf, mask_rows, row_of);
}

void Apply(const Tensor& logits, const Tensor& bitmask,
           const tvm::ffi::Optional<Tensor>& token_mask, int64_t col_offset, int64_t mask_rows,
           RowIndex row_of) {
  if (logits.ndim() != 2 || bitmask.ndim() != 2 || logits.device().device_type != kDLCPU ||
      bitmask.device().device_type != kDLCPU) {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: 2-D CPU logits and bitmask expected";
  }
  const DLDataType bt = bitmask.dtype();
  if (bt.code != kDLInt || bt.bits != 32 || bitmask.stride(1) != 1 ||
      (logits.size(1) > 1 && logits.stride(1) != 1)) {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: int32 bitmask and unit column strides expected";
  }
  if (bitmask.size(0) < mask_rows || col_offset < 0 ||
      (col_offset + logits.size(1) + 31) / 32 > bitmask.size(1)) {
    TVM_FFI_THROW(ValueError) << "apply_bitmask: the bitmask does not cover the logits";
  }
  const int32_t* tm = nullptr;
  if (token_mask.has_value()) {
    const Tensor& t = token_mask.value();
    if (t.ndim() != 1 || t.dtype().code != kDLInt || t.dtype().bits != 32 ||
        t.device().device_type != kDLCPU || t.size(0) < mask_rows ||
        (t.size(0) > 1 && t.stride(0) != 1)) {
      TVM_FFI_THROW(TypeError) << "apply_bitmask: token_mask must be [>= rows] int32 on CPU";
    }
    tm = static_cast<const int32_t*>(t.data_ptr());
  }
  const DLDataType lt = logits.dtype();
  if (lt.code == kDLFloat && lt.bits == 32) {
    MaskRowsWide32(logits, bitmask, tm, col_offset, 0xFF800000u, mask_rows, row_of);
  } else if (lt.code == kDLFloat && lt.bits == 16) {
    MaskRowsWide16(logits, bitmask, tm, col_offset, 0xFC00u, mask_rows, row_of);
  } else if (lt.code == kDLBfloat && lt.bits == 16) {
    MaskRowsWide16(logits, bitmask, tm, col_offset, 0xFF80u, mask_rows, row_of);
  } else {
    TVM_FFI_THROW(TypeError) << "apply_bitmask: float32, float16 or bfloat16 logits expected";
  }
}

void ApplyBitmask(Tensor logits, Tensor bitmask, tvm::ffi::Optional<Tensor> token_mask,
                  int64_t col_offset) {
  Apply(logits, bitmask, token_mask, col_offset, logits.ndim() == 2 ? logits.size(0) : 0,
        RowIndex{});
}

void ApplyBitmaskIndices(Tensor logits, Tensor bitmask, tvm::ffi::Optional<Tensor> token_mask,
                         int64_t col_offset, Tensor indices) {
  const DLDataType it = indices.dtype();
  if (indices.ndim() != 1 || it.code != kDLInt || (it.bits != 32 && it.bits != 64) ||
      indices.device().device_type != kDLCPU || (indices.size(0) > 1 && indices.stride(0) != 1)) {
    TVM_FFI_THROW(TypeError) << "apply_bitmask_indices: indices must be dense 1-D int32 or "
                                "int64 on CPU";
  }
  Apply(logits, bitmask, token_mask, col_offset, indices.size(0),
        RowIndex{indices.data_ptr(), it.bits == 64});
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_bitmask, ApplyBitmask);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(apply_bitmask_indices, ApplyBitmaskIndices);

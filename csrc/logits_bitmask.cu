// logits_bitmask: set the logits of disallowed tokens to -inf, in place.
//
// Semantics (the same as capgraph/ops/reference.py): row r, column j of the logits stands for
//   * without d2t: global id  t = col_offset + j
//   * with d2t:    draft id   g = col_offset + j, global (target) id t = g + d2t[g]
// and is masked (written as -inf) where bit (t % 32) of word (t / 32) of bitmask row r is 0.
// A d2t target outside the row's bits [0, 32 * bitmask_words) is masked without being read:
// a bad table (a value changed where no host check saw it) never reads outside the row.
// Rows whose token_mask entry is 0 are not touched. token_mask may be null.
// Rows are mask rows: mask row r reads bitmask row r and token_mask[r] and masks logits row r,
// or logits row indices[r] where indices is not null (int32 or int64 entries, index_bytes 4 or
// 8); an index outside [0, logits_rows) is skipped, so a bad index never writes out of bounds.
//
// Grid: x = blocks along the row (each covers kThreads * kBitsPerThread columns), y = rows
// (a grid-stride loop over rows past 65535). Each thread handles groups of kPack adjacent
// columns, one packed (up to 16-byte) load/store per group, and classifies each group:
//   all allowed -> no logits traffic at all;
//   all masked  -> one packed store of -inf, nothing read;
//   mixed       -> depends on the variant (enum Mixed):
//     rmw   (the default entry points) reads the group after its bitmask word, patches the
//           masked lanes and writes it back: two dependent memory round trips per group,
//           after the token-mask entry's;
//     ahead (entry points suffixed _ahead) issues every group's packed logits load together
//           with its bitmask loads and the row's token-mask entry, before any is used, so no
//           read waits for another; all-allowed groups (and inactive rows) are then read for
//           nothing (extra traffic that only a small, latency-bound launch can afford);
//     store (suffixed _store) never reads a mixed group: each masked lane is stored alone,
//           allowed lanes are not touched (a masked store); its bitmask and token-mask loads
//           are issued together too, so a row costs it one round trip before its stores.
// With kPack == 1 no group is mixed, and the variants differ only in that order of loads.
// With indices the logits row is known only once its index is read: the variants then read
// token mask, index and the row's data one after the other, as rmw does.
// Which one a launch uses is the host's choice (capgraph/ops/cuda.py: rmw unless
// CAPGRAPH_MASK_KERNEL says otherwise); tools/bench_kernel.py measures all three.
// (Measured on an H200 earlier: single-lane stores with a per-warp vote for the way to go were
// 13-15% faster on 98%-allowed rows but 6-13% slower on random and 2%-allowed rows at large
// batches.)
//
// Measured on an H200 (docs/BENCHMARKS.md): with the d2t lookups compiled into the same entry
// point, the plain path used up to 100 registers, a quarter of full occupancy, and ran at half
// the bandwidth it reaches alone; d2t therefore has entry points of its own. 32 columns per
// thread was slower than 16 at every large batch size measured.
//
// The kernel works on the raw bits of the logits (uint32 for fp32, uint16 for fp16/bf16), so
// -inf is an exact bit pattern in every dtype and allowed entries keep every bit (NaN payloads
// included). That also keeps the file free of includes: it compiles with NVRTC (no include path)
// and with `nvcc -c`.
//
// Entry points are extern "C" (unmangled, so NVRTC needs no name expressions):
//   capgraph_logits_bitmask_<f32|f16|bf16>_b<4|8|16>_p<1|2|4|8>[_d2t|_ahead|_store]
// b = bits (columns) per thread, p = columns per packed access (p * element size <= 16 bytes,
// p <= b); the _d2t entries read the draft-to-target table (rmw only), the others ignore that
// argument; _ahead and _store name the variants above (b 4 and 8 only, see the end of the file).
// Every scalar parameter is 64-bit so that a launcher passing plain Python ints (pointer-sized)
// matches the ABI without per-argument type annotations.
//
// Host contract (capgraph/ops/cuda.py checks it before choosing an entry point): p divides
// width and the logits row stride, the logits base pointer is aligned to p * element size,
// width and col_offset + width fit in int32, every id a column reads without d2t lies inside its
// bitmask row (with d2t the kernel bounds each target itself, above).

namespace capgraph {

constexpr int kThreads = 256;
constexpr int kWordBits = 32;

// How a thread handles a mixed group (see the top of the file).
enum class Mixed { kReadModifyWrite, kLoadAhead, kLaneStores };

// Raw storage of one packed group: the widest plain load/store of that many bytes.
template <int kBytes> struct PackStorage;
template <> struct PackStorage<16> { typedef uint4 type; };
template <> struct PackStorage<8> { typedef uint2 type; };
template <> struct PackStorage<4> { typedef unsigned int type; };
template <> struct PackStorage<2> { typedef unsigned short type; };

// kPack elements of raw bits E, viewed either as one storage word or element by element.
template <typename E, int kPack>
union Pack {
    typename PackStorage<int(sizeof(E)) * kPack>::type raw;
    E element[kPack];
};

// Allowed bits of the kPack global ids starting at `bit` (bit i of the result: id bit + i).
// col_offset need not be a multiple of 32 (or of kPack), so a group may straddle two words; the
// second word is read only then, and it always holds a column's bit, so it lies inside the row.
template <int kPack>
__device__ __forceinline__ unsigned allowed_bits(const unsigned* __restrict__ row_words,
                                                 long long bit) {
    const long long word = bit >> 5;
    const int shift = int(bit & (kWordBits - 1));
    unsigned bits = row_words[word] >> shift;
    if (kPack > 1 && shift + kPack > kWordBits) {
        bits |= row_words[word + 1] << (kWordBits - shift);  // shift > 24 here: no UB
    }
    return bits & ((1u << kPack) - 1u);
}

// Allowed bits through the draft-to-target table: one bit lookup per column; a target outside
// the row's row_bits bits is masked, its word never read.
template <int kPack>
__device__ __forceinline__ unsigned allowed_bits_d2t(const unsigned* __restrict__ row_words,
                                                     const int* __restrict__ d2t,
                                                     long long draft_id, long long row_bits) {
    unsigned bits = 0;
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
        const long long g = draft_id + i;
        const long long t = g + d2t[g];
        if (t >= 0 && t < row_bits) {
            bits |= ((row_words[t >> 5] >> int(t & (kWordBits - 1))) & 1u) << i;
        }
    }
    return bits;
}

// One row's columns of this thread in the ahead and store variants. Every load comes first:
// each group's bitmask word(s) and, for ahead, its packed logits, then the row's token-mask
// entry (where `active` is not null); only then is any loaded value used. A thread stalls at
// the first use of a load's result, so the loads are all in flight together: one memory round
// trip per row, where rmw takes the token mask's, then one or two per group. An inactive row's
// loads are wasted, its logits untouched.
template <typename E, E kNegInf, int kBitsPerThread, int kPack, Mixed kMixed>
__device__ __forceinline__ void mask_row_loads_first(E* __restrict__ row_logits,
                                                     const unsigned* __restrict__ row_words,
                                                     const int* __restrict__ active,
                                                     int block_col, int width32,
                                                     long long col_offset) {
    typedef Pack<E, kPack> PackT;
    constexpr int kGroups = kBitsPerThread / kPack;
    constexpr unsigned kAllMasked = (1u << kPack) - 1u;
    PackT packs[kGroups];
    unsigned low[kGroups], high[kGroups];  // the word holding the group's first bit, the next
#pragma unroll
    for (int step = 0; step < kGroups; ++step) {
        const int col = block_col + (step * kThreads + int(threadIdx.x)) * kPack;
        low[step] = ~0u;  // past the row's end: all allowed, nothing written
        high[step] = ~0u;
        if (col < width32) {
            const long long bit = col_offset + col;
            low[step] = row_words[bit >> 5];
            if (kPack > 1 && int(bit & (kWordBits - 1)) + kPack > kWordBits) {
                high[step] = row_words[(bit >> 5) + 1];  // the group straddles two words
            }
            if constexpr (kMixed == Mixed::kLoadAhead) {
                packs[step].raw = reinterpret_cast<const PackT*>(row_logits + col)->raw;
            }
        }
    }
    if (active != nullptr && *active == 0) {
        return;
    }
#pragma unroll
    for (int step = 0; step < kGroups; ++step) {
        const int col = block_col + (step * kThreads + int(threadIdx.x)) * kPack;
        const int shift = int((col_offset + col) & (kWordBits - 1));
        unsigned allowed = low[step] >> shift;
        if (kPack > 1 && shift + kPack > kWordBits) {
            allowed |= high[step] << (kWordBits - shift);  // shift > 24 here: no UB
        }
        const unsigned masked = ~allowed & kAllMasked;
        if (masked == 0) {
            continue;  // all allowed, or past the row's end
        }
        if constexpr (kMixed == Mixed::kLaneStores) {
            if (masked != kAllMasked) {  // mixed: the masked lanes alone, no read
#pragma unroll
                for (int i = 0; i < kPack; ++i) {
                    if ((masked >> i) & 1u) {
                        row_logits[col + i] = kNegInf;
                    }
                }
                continue;
            }
        }
#pragma unroll
        for (int i = 0; i < kPack; ++i) {
            if ((masked >> i) & 1u) {
                packs[step].element[i] = kNegInf;
            }
        }
        reinterpret_cast<PackT*>(row_logits + col)->raw = packs[step].raw;
    }
}

template <typename E, E kNegInf, int kBitsPerThread, int kPack, bool kD2t, Mixed kMixed>
__device__ __forceinline__ void mask_logits(E* __restrict__ logits, long long logits_row_stride,
                                            const unsigned* __restrict__ bitmask,
                                            long long bitmask_row_stride,
                                            const int* __restrict__ token_mask,
                                            const int* __restrict__ d2t, long long rows,
                                            long long width, long long col_offset,
                                            const void* __restrict__ indices,
                                            long long index_bytes, long long logits_rows,
                                            long long bitmask_words) {
    static_assert(kBitsPerThread % kPack == 0, "a thread handles whole packed groups");
    static_assert(int(sizeof(E)) * kPack <= 16, "at most 16 bytes per access");
    static_assert(!kD2t || kMixed == Mixed::kReadModifyWrite, "d2t entries are rmw only");
    typedef Pack<E, kPack> PackT;
    constexpr unsigned kAllMasked = (1u << kPack) - 1u;
    const int width32 = int(width);
    const int block_col = int(blockIdx.x) * (kThreads * kBitsPerThread);

    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        if constexpr (kMixed != Mixed::kReadModifyWrite) {
            if (indices == nullptr) {  // the token-mask entry is loaded with the row's data
                mask_row_loads_first<E, kNegInf, kBitsPerThread, kPack, kMixed>(
                    logits + row * logits_row_stride, bitmask + row * bitmask_row_stride,
                    token_mask == nullptr ? nullptr : token_mask + row, block_col, width32,
                    col_offset);
                continue;
            }
        }
        // The cheapest line of the kernel: an inactive row costs one load per block.
        if (token_mask != nullptr && token_mask[row] == 0) {
            continue;
        }
        long long logits_row = row;
        if (indices != nullptr) {  // one load per row and block, outside the column loop
            logits_row = index_bytes == 8 ? static_cast<const long long*>(indices)[row]
                                          : static_cast<long long>(
                                                static_cast<const int*>(indices)[row]);
            if (logits_row < 0 || logits_row >= logits_rows) {
                continue;
            }
        }
        E* row_logits = logits + logits_row * logits_row_stride;
        const unsigned* row_words = bitmask + row * bitmask_row_stride;
        if constexpr (kMixed != Mixed::kReadModifyWrite) {
            mask_row_loads_first<E, kNegInf, kBitsPerThread, kPack, kMixed>(
                row_logits, row_words, nullptr, block_col, width32, col_offset);
        } else {
#pragma unroll
            for (int step = 0; step < kBitsPerThread / kPack; ++step) {
                // consecutive threads take consecutive groups: coalesced logits accesses, and
                // the 32 / kPack threads that share a bitmask word read it from one cache line
                const int col = block_col + (step * kThreads + int(threadIdx.x)) * kPack;
                if (col >= width32) {
                    break;
                }
                const unsigned allowed = kD2t
                    ? allowed_bits_d2t<kPack>(row_words, d2t, col_offset + col,
                                              bitmask_words * kWordBits)
                    : allowed_bits<kPack>(row_words, col_offset + col);
                const unsigned masked = ~allowed & kAllMasked;
                if (masked == 0) {
                    continue;  // all allowed: no memory traffic
                }
                PackT* where = reinterpret_cast<PackT*>(row_logits + col);
                PackT pack;
                if (masked == kAllMasked) {  // all masked: write -inf, read nothing
#pragma unroll
                    for (int i = 0; i < kPack; ++i) {
                        pack.element[i] = kNegInf;
                    }
                } else {  // mixed: read-modify-write
                    pack.raw = where->raw;
#pragma unroll
                    for (int i = 0; i < kPack; ++i) {
                        if ((masked >> i) & 1u) {
                            pack.element[i] = kNegInf;
                        }
                    }
                }
                where->raw = pack.raw;
            }
        }
    }
}

// Bit patterns of -inf: IEEE binary32, binary16, bfloat16.
constexpr unsigned kNegInfF32 = 0xFF800000u;
constexpr unsigned short kNegInfF16 = 0xFC00u;
constexpr unsigned short kNegInfBF16 = 0xFF80u;

}  // namespace capgraph

#define CAPGRAPH_LOGITS_BITMASK_KERNEL(NAME, E, NEG_INF, BITS, PACK, D2T, MIXED)              \
    extern "C" __global__ void __launch_bounds__(capgraph::kThreads) NAME(                    \
        E* __restrict__ logits, long long logits_row_stride,                                  \
        const unsigned* __restrict__ bitmask, long long bitmask_row_stride,                   \
        const int* __restrict__ token_mask, const int* __restrict__ d2t, long long rows,      \
        long long width, long long col_offset, const void* __restrict__ indices,              \
        long long index_bytes, long long logits_rows, long long bitmask_words) {              \
        capgraph::mask_logits<E, NEG_INF, BITS, PACK, D2T, capgraph::Mixed::MIXED>(           \
            logits, logits_row_stride, bitmask, bitmask_row_stride, token_mask, d2t, rows,    \
            width, col_offset, indices, index_bytes, logits_rows, bitmask_words);             \
    }

// one (dtype, bits, pack): the plain entry point and its d2t twin
#define CAPGRAPH_LOGITS_BITMASK_ENTRY(DTYPE, E, NEG_INF, BITS, PACK)                          \
    CAPGRAPH_LOGITS_BITMASK_KERNEL(capgraph_logits_bitmask_##DTYPE##_b##BITS##_p##PACK, E,    \
                                   NEG_INF, BITS, PACK, false, kReadModifyWrite)              \
    CAPGRAPH_LOGITS_BITMASK_KERNEL(capgraph_logits_bitmask_##DTYPE##_b##BITS##_p##PACK##_d2t, \
                                   E, NEG_INF, BITS, PACK, true, kReadModifyWrite)

// one (dtype, bits, pack): the two mixed-group variants of the plain entry point
#define CAPGRAPH_LOGITS_BITMASK_VARIANTS(DTYPE, E, NEG_INF, BITS, PACK)                       \
    CAPGRAPH_LOGITS_BITMASK_KERNEL(                                                           \
        capgraph_logits_bitmask_##DTYPE##_b##BITS##_p##PACK##_ahead, E, NEG_INF, BITS,        \
        PACK, false, kLoadAhead)                                                              \
    CAPGRAPH_LOGITS_BITMASK_KERNEL(                                                           \
        capgraph_logits_bitmask_##DTYPE##_b##BITS##_p##PACK##_store, E, NEG_INF, BITS,        \
        PACK, false, kLaneStores)

// fp32: packs of 1, 2, 4 elements (4, 8, 16 bytes)
#define CAPGRAPH_F32_ENTRIES(ENTRY, BITS)                                                     \
    ENTRY(f32, unsigned, capgraph::kNegInfF32, BITS, 1)                                       \
    ENTRY(f32, unsigned, capgraph::kNegInfF32, BITS, 2)                                       \
    ENTRY(f32, unsigned, capgraph::kNegInfF32, BITS, 4)

// 16-bit dtypes: packs of 1, 2, 4 elements, and 8 (16 bytes) where a thread covers >= 8 bits
#define CAPGRAPH_16BIT_ENTRIES(ENTRY, DTYPE, NEG_INF, BITS)                                   \
    ENTRY(DTYPE, unsigned short, NEG_INF, BITS, 1)                                            \
    ENTRY(DTYPE, unsigned short, NEG_INF, BITS, 2)                                            \
    ENTRY(DTYPE, unsigned short, NEG_INF, BITS, 4)
#define CAPGRAPH_16BIT_ENTRIES_WIDE(ENTRY, DTYPE, NEG_INF, BITS)                              \
    CAPGRAPH_16BIT_ENTRIES(ENTRY, DTYPE, NEG_INF, BITS)                                       \
    ENTRY(DTYPE, unsigned short, NEG_INF, BITS, 8)

// every dtype at BITS columns per thread: f32, then f16 and bf16 with the packs SIXTEEN gives
#define CAPGRAPH_ALL_DTYPES(ENTRY, BITS, SIXTEEN)                                             \
    CAPGRAPH_F32_ENTRIES(ENTRY, BITS)                                                         \
    SIXTEEN(ENTRY, f16, capgraph::kNegInfF16, BITS)                                           \
    SIXTEEN(ENTRY, bf16, capgraph::kNegInfBF16, BITS)

// rmw and d2t at 4, 8 and 16 columns per thread
CAPGRAPH_ALL_DTYPES(CAPGRAPH_LOGITS_BITMASK_ENTRY, 4, CAPGRAPH_16BIT_ENTRIES)
CAPGRAPH_ALL_DTYPES(CAPGRAPH_LOGITS_BITMASK_ENTRY, 8, CAPGRAPH_16BIT_ENTRIES_WIDE)
CAPGRAPH_ALL_DTYPES(CAPGRAPH_LOGITS_BITMASK_ENTRY, 16, CAPGRAPH_16BIT_ENTRIES_WIDE)

// the ahead and store variants at 4 and 8 columns per thread only: what a launch of up to 16
// rows chooses at V = 128000 on an H200, the latency-bound range they are for (at every width
// they more than doubled NVRTC's compile time)
CAPGRAPH_ALL_DTYPES(CAPGRAPH_LOGITS_BITMASK_VARIANTS, 4, CAPGRAPH_16BIT_ENTRIES)
CAPGRAPH_ALL_DTYPES(CAPGRAPH_LOGITS_BITMASK_VARIANTS, 8, CAPGRAPH_16BIT_ENTRIES_WIDE)

// ---- masked_argmax: greedy sampling fused with the mask ------------------------------------
//
// out[r] = the column of the largest logit among row r's allowed tokens, that is
// argmax(row r masked as above), for rows [0, rows); rows at or past mask_rows, and rows whose
// token_mask entry is 0, are not masked (a plain argmax). The logits are only read: a masked
// column is -inf without a load, so a row costs its bitmask words plus the logits of its
// allowed tokens, where masking in place and then taking the argmax reads every logit twice
// and writes the masked ones. (Memory moves in 32-byte sectors: a sector is read where any of
// its 8 fp32 or 16 fp16/bf16 columns is allowed, so with 2% of the bits set at random about
// 15% of an fp32 row's sectors are read; a grammar's allowed tokens cluster, which reads
// fewer.)
//
// The result is the one torch.argmax gives on the masked row: the values compare as floats
// (fp16 and bf16 widened to fp32 exactly), -0 equals +0, NaN is larger than everything, and of
// equal values the lowest column wins; a row with nothing allowed (every entry -inf) gives its
// lowest column. Each candidate is one 64-bit key, ordered as that comparison orders (the
// float's bits mapped to an unsigned order in the high half, the column's complement in the
// low half), so the whole reduction is an unsigned max.
//
// Grid: x = blocks along the row (each covers kArgmaxWordsPerBlock bitmask words, 32 columns
// each), y = rows (a grid-stride loop past 65535). Warp w of a block takes kArgmaxWordsPerWarp
// consecutive words; lane l reads column 32 * word + l, so a warp's logits loads are coalesced
// and a word with no allowed bit costs no logits load. The block's best key (warp shuffles,
// then one key per warp in shared memory) is merged by its thread 0 into keys[row] (an atomic
// max), which then counts the block in counts[row]; the row's last block to count writes
// out[row] and puts both back to 0, so the scratch is ready for the next launch without a
// memset (it must be all zero before the first). One launch at a time may use a scratch.
//
// Host contract (capgraph/ops/cuda.py plan_argmax): width <= 32 * bitmask row words, width and
// the columns fit in int32, out int64 [>= rows], keys and counts [>= rows] 64-bit and zero.

namespace capgraph {

constexpr int kArgmaxWordsPerWarp = 16;
constexpr int kArgmaxWordsPerBlock = (kThreads / 32) * kArgmaxWordsPerWarp;

// fp32 bits of a logit: fp32 as it is, bf16 shifted, fp16 converted exactly (integer ops only:
// the file takes no headers).
struct ArgmaxF32 {
    typedef unsigned Raw;
    static __device__ __forceinline__ unsigned f32_bits(unsigned raw) { return raw; }
};
struct ArgmaxBF16 {
    typedef unsigned short Raw;
    static __device__ __forceinline__ unsigned f32_bits(unsigned short raw) {
        return unsigned(raw) << 16;
    }
};
struct ArgmaxF16 {
    typedef unsigned short Raw;
    static __device__ __forceinline__ unsigned f32_bits(unsigned short raw) {
        const unsigned sign = (unsigned(raw) & 0x8000u) << 16;
        const unsigned exponent = (unsigned(raw) >> 10) & 0x1Fu;
        unsigned mantissa = unsigned(raw) & 0x3FFu;
        if (exponent == 0x1Fu) {
            return sign | 0x7F800000u | (mantissa << 13);  // inf, NaN
        }
        if (exponent == 0) {
            if (mantissa == 0) {
                return sign;  // +-0
            }
            unsigned biased = 113;  // a subnormal: shift its leading 1 up to the implicit bit
            while ((mantissa & 0x400u) == 0) {
                mantissa <<= 1;
                --biased;
            }
            return sign | (biased << 23) | ((mantissa & 0x3FFu) << 13);
        }
        return sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
};

// The key of fp32 bits at `col`: larger is better (see the section's comment); 0 is none.
__device__ __forceinline__ unsigned long long argmax_key(unsigned bits, long long col) {
    unsigned order;
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
        order = 0xFFFFFFFFu;  // NaN: above every number
    } else {
        if (bits == 0x80000000u) {
            bits = 0;  // -0 equals +0
        }
        order = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    }
    return (static_cast<unsigned long long>(order) << 32) |
           static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<unsigned>(col));
}

// The key of a masked column: -inf (fp32 bits 0xFF800000) at `col`.
__device__ __forceinline__ unsigned long long masked_key(long long col) {
    return (static_cast<unsigned long long>(~0xFF800000u) << 32) |
           static_cast<unsigned long long>(0xFFFFFFFFu - static_cast<unsigned>(col));
}

#ifndef CAPGRAPH_EMULATED_WARPS
// The block's largest key, in thread 0; true in thread 0 only. Every thread of the block calls
// it (it synchronises the block); `merged` is the block's shared scratch of one key per warp.
__device__ __forceinline__ bool block_max_to_thread0(unsigned long long* key,
                                                     unsigned long long* merged) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, *key, offset);
        *key = other > *key ? other : *key;
    }
    if ((threadIdx.x & 31u) == 0) {
        merged[threadIdx.x >> 5] = *key;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int w = 1; w < kThreads / 32; ++w) {
            *key = merged[w] > *key ? merged[w] : *key;
        }
    }
    __syncthreads();  // (`merged` is written again for the block's next row)
    return threadIdx.x == 0;
}
constexpr int kArgmaxMergersPerBlock = 1;
#else
// The host emulation (tests/test_kernel_compile.py) runs a block's threads one after another:
// each thread merges its own key, as a block of one.
__device__ __forceinline__ bool block_max_to_thread0(unsigned long long*, unsigned long long*) {
    return true;
}
constexpr int kArgmaxMergersPerBlock = kThreads;
#endif

template <typename Kind>
__device__ __forceinline__ void masked_argmax(const typename Kind::Raw* __restrict__ logits,
                                              long long logits_row_stride,
                                              const unsigned* __restrict__ bitmask,
                                              long long bitmask_row_stride,
                                              const int* __restrict__ token_mask,
                                              long long rows, long long mask_rows,
                                              long long width, long long* __restrict__ out,
                                              unsigned long long* __restrict__ keys,
                                              unsigned long long* __restrict__ counts) {
    const int lane = int(threadIdx.x & 31u);
    const long long first_word = static_cast<long long>(blockIdx.x) * kArgmaxWordsPerBlock +
                                 (threadIdx.x >> 5) * kArgmaxWordsPerWarp;
    const unsigned long long mergers =
        static_cast<unsigned long long>(gridDim.x) * kArgmaxMergersPerBlock;
#ifndef CAPGRAPH_EMULATED_WARPS
    __shared__ unsigned long long merged[kThreads / 32];
#else
    unsigned long long* merged = nullptr;
#endif
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        const bool guided = row < mask_rows && (token_mask == nullptr || token_mask[row] != 0);
        const typename Kind::Raw* row_logits = logits + row * logits_row_stride;
        const unsigned* row_words = bitmask + row * bitmask_row_stride;
        unsigned words[kArgmaxWordsPerWarp];
#pragma unroll
        for (int k = 0; k < kArgmaxWordsPerWarp; ++k) {  // every word first: loads in flight
            const long long col = (first_word + k) * kWordBits + lane;
            words[k] = col < width ? (guided ? row_words[first_word + k] : ~0u) : 0u;
        }
        unsigned long long best = 0;
#pragma unroll
        for (int k = 0; k < kArgmaxWordsPerWarp; ++k) {
            const long long col = (first_word + k) * kWordBits + lane;
            if (col >= width) {
                break;
            }
            const unsigned long long key = ((words[k] >> lane) & 1u)
                ? argmax_key(Kind::f32_bits(row_logits[col]), col)
                : masked_key(col);
            best = key > best ? key : best;
        }
        if (!block_max_to_thread0(&best, merged)) {
            continue;
        }
        if (best != 0) {
            atomicMax(keys + row, best);
        }
        __threadfence();  // (the max lands before the count that may let another warp read it)
        if (atomicAdd(counts + row, 1ull) == mergers - 1) {  // the row's last merger
            __threadfence();
            const unsigned long long key = atomicExch(keys + row, 0ull);
            atomicExch(counts + row, 0ull);
            out[row] = key == 0 ? 0
                                : static_cast<long long>(0xFFFFFFFFu -
                                                         static_cast<unsigned>(key & 0xFFFFFFFFull));
        }
    }
}

}  // namespace capgraph

#define CAPGRAPH_MASKED_ARGMAX_KERNEL(DTYPE, KIND)                                            \
    extern "C" __global__ void __launch_bounds__(capgraph::kThreads)                          \
        capgraph_masked_argmax_##DTYPE(                                                       \
            const capgraph::KIND::Raw* __restrict__ logits, long long logits_row_stride,      \
            const unsigned* __restrict__ bitmask, long long bitmask_row_stride,               \
            const int* __restrict__ token_mask, long long rows, long long mask_rows,          \
            long long width, long long* __restrict__ out, unsigned long long* keys,           \
            unsigned long long* counts) {                                                     \
        capgraph::masked_argmax<capgraph::KIND>(logits, logits_row_stride, bitmask,           \
                                                bitmask_row_stride, token_mask, rows,         \
                                                mask_rows, width, out, keys, counts);         \
    }

CAPGRAPH_MASKED_ARGMAX_KERNEL(f32, ArgmaxF32)
CAPGRAPH_MASKED_ARGMAX_KERNEL(f16, ArgmaxF16)
CAPGRAPH_MASKED_ARGMAX_KERNEL(bf16, ArgmaxBF16)

// Attention of a few query rows over a long bfloat16 cache, on a CPU with AVX512-BF16: the `specheads::decode_attention`
// op (built and registered by inference/kernels.py). ATen's flash attention reads such a cache at 11-16 GB/s
// on a 2-core EPYC, for one query token a row; this reads it at 55-66 GB/s, near what the memory gives.
//
// query [B, H, G, D] (G query rows a key/value head: its query heads folded into the rows), key and value [B, H, L, D]
// (the last dim contiguous), mask [B, 1, Q, L] additive, row g reading mask row g % Q. Scores are exact fp32 dot
// products of the bfloat16 values (AVX512-BF16's dot product), the softmax in fp32, the weighted sum of the values a
// dot product too, over the probabilities rounded to bfloat16 (as ATen's flash attention rounds them), summed in fp32;
// only the keys some query row of a row's mask sees are read (a batch's shorter rows skip the longest row's stretch),
// split into chunks across threads and merged by their maxima (flash decoding). Anything else (more rows, on a CPU
// with AMX many rows over many keys, float32, another head size) goes to ATen's scaled_dot_product_attention, so a
// compiled graph has one op for every shape.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 64;  // more query rows a head (a prompt's chunk): ATen's flash, built for those
// With AMX tiles, ATen's flash attention (its products on the tiles) is faster where a head's rows times its keys
// make enough products: 16 tree tokens (48 rows under 3 query heads a key head) over a thousand keys, or a tree over a
// long prompt; with fewer rows or keys this kernel is as fast or faster (docs/experiments.md, row X27)
constexpr int64_t kAmxRows = 12, kAmxProducts = 32768;  // rows a head, rows x keys

bool has_amx_tiles() {
  static const bool amx = [] {
    const auto capabilities = at::cpu::get_cpu_capabilities();
    const auto found = capabilities.find("amx_tile");
    return found != capabilities.end() && found->second.toBool();
  }();
  return amx;
}
using Vec = at::vec::Vectorized<float>;

inline __m512 load16(const at::BFloat16* p) {  // 16 bfloat16 -> fp32 (a shift of the bits)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 x 16 32-bit elements: rows r[i] -> columns (r[i] lane j becomes r[j] lane i)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

struct Partial {  // one chunk's softmax over its keys, for one row: max, sum of exp, and the weighted values
  float* max;
  float* sum;
  float* acc;
};

// rows [G, D] of one head against its keys [begin, end): scores into `s` [G, end - begin] (and, rounded, `p`), then
// the chunk's partials
template <int D>
void attend_chunk(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const at::BFloat16* mask,
                  int64_t mask_row_stride, int64_t G, int64_t Q, int64_t begin, int64_t end, float scale, float* s,
                  int32_t* p, Partial out) {
  constexpr int kPairs = D / 2;  // bfloat16 pairs in a row: one 32-bit lane each
  const int64_t n = end - begin;
  const auto* q32 = reinterpret_cast<const int32_t*>(q);
  int64_t l = begin;
  // 16 keys at once, their pairs transposed so that a lane is a key's score: two dot-product instructions a row and
  // key (64 dims) instead of a horizontal sum each; with fewer than 8 rows the transposes cost more than they save
  for (; G >= 8 && l + 16 <= end; l += 16) {
    __m512i kt[kPairs];
    for (int block = 0; block < kPairs / 16; ++block) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + (l + i) * D + block * 32);
      transpose16(r);
      for (int i = 0; i < 16; ++i) kt[block * 16 + i] = r[i];
    }
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {  // four rows at once: four independent chains of dot products
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int p = 0; p < kPairs; ++p)
        for (int r = 0; r < 4; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(q32[(g + r) * kPairs + p]), (__m512bh)kt[p]);
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(s + (g + r) * n + (l - begin), acc[r]);
    }
    for (; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int p = 0; p < kPairs; ++p)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(q32[g * kPairs + p]), (__m512bh)kt[p]);
      _mm512_storeu_ps(s + g * n + (l - begin), acc);
    }
  }
  if (l < end) {  // one key at a time: few rows, and the last keys
    __m512bh qv[kMaxRows][D / 32];
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < D / 32; ++j) qv[g][j] = (__m512bh)_mm512_loadu_si512(q + g * D + j * 32);
    for (; l < end; ++l) {
      __m512bh kv[D / 32];
      for (int j = 0; j < D / 32; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(k + l * D + j * 32);
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < D / 32; ++j) acc = _mm512_dpbf16_ps(acc, qv[g][j], kv[j]);
        s[g * n + (l - begin)] = _mm512_reduce_add_ps(acc);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * n;
    const at::BFloat16* m = mask + (g % Q) * mask_row_stride + begin;
    int64_t i = 0;
    Vec top(-std::numeric_limits<float>::infinity());
    for (; i + 16 <= n; i += 16) {
      const Vec x = Vec::loadu(row + i) * Vec(scale) + Vec(load16(m + i));
      x.store(row + i);
      top = at::vec::maximum(top, x);
    }
    float most = _mm512_reduce_max_ps(__m512(top));
    for (; i < n; ++i) {
      row[i] = row[i] * scale + static_cast<float>(m[i]);
      most = std::max(most, row[i]);
    }
    if (std::isinf(most) && most < 0) {  // every key masked off with -inf: the chunk adds nothing
      out.max[g] = most;
      out.sum[g] = 0.f;
      std::fill(out.acc + g * D, out.acc + (g + 1) * D, 0.f);
      std::fill(row, row + n, 0.f);
      continue;
    }
    Vec total(0.f);
    for (i = 0; i + 16 <= n; i += 16) {
      const Vec e = (Vec::loadu(row + i) - Vec(most)).exp_u20();
      e.store(row + i);
      total = total + e;
    }
    float sum = _mm512_reduce_add_ps(__m512(total));
    for (; i < n; ++i) {
      row[i] = std::exp(row[i] - most);
      sum += row[i];
    }
    out.max[g] = most;
    out.sum[g] = sum;
  }
  // The weighted sum over the values, two keys a dot product: the probabilities rounded to bfloat16 (as ATen's flash
  // attention rounds them before its product with the values; the sums above stay fp32), a pair of keys' values
  // interleaved once for every row. Half the instructions of fp32 multiply-adds: with a tree's rows over a long
  // cache, this product is most of the attention.
  const int64_t pairs = (n + 1) / 2;  // an odd chunk's last key pairs with a zero probability
  for (int64_t g = 0; g < G; ++g) {
    const float* row = s + g * n;
    auto* packed = reinterpret_cast<at::BFloat16*>(p + g * pairs);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
    for (; i < n; ++i) packed[i] = at::BFloat16(row[i]);
    if (n % 2 == 1) packed[n] = at::BFloat16(0.f);
  }
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  constexpr int kRowsAtOnce = 6;  // rows whose sums stay in registers while the values stream past
  for (int64_t first = 0; first < G; first += kRowsAtOnce) {
    const int64_t rows = std::min<int64_t>(kRowsAtOnce, G - first);
    __m512 o[kRowsAtOnce][D / 16];
    for (int g = 0; g < kRowsAtOnce; ++g)
      for (int j = 0; j < D / 16; ++j) o[g][j] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t l = begin + 2 * pair, next = l + 1 < end ? l + 1 : l;  // a lone last key: its own partner
      __m512bh vv[D / 16];  // 16 dimensions of both keys' values, alternating
      for (int j = 0; j < D / 16; ++j) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + l * D + j * 16));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + next * D + j * 16));
        vv[j] = (__m512bh)_mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
      for (int g = 0; g < rows; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p[(first + g) * pairs + pair]);
        for (int j = 0; j < D / 16; ++j) o[g][j] = _mm512_dpbf16_ps(o[g][j], w, vv[j]);
      }
    }
    for (int g = 0; g < rows; ++g)
      for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(out.acc + (first + g) * D + j * 16, o[g][j]);
  }
}

// The keys [begin, end) that some query row of a mask [Q, L] (its rows `row_stride` apart) may see, in blocks of 16:
// rows of a batch share one cache as long as the longest, and a shorter row's keys between its own end and the
// step's new entries are masked off for all its queries. A masked key adds exactly nothing (its mask, the dtype's
// minimum or -inf, takes its probability to 0 beside any seen key), so only these ranges are read. A mask that
// hides every key keeps them all, to compute what it computed before.
std::vector<std::pair<int64_t, int64_t>> seen_ranges(const at::BFloat16* mask, int64_t row_stride, int64_t Q,
                                                     int64_t L) {
  constexpr float kMasked = -1e30f;  // at or below: no probability beside a seen key
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t begin = 0; begin < L; begin += 16) {
    const int64_t end = std::min(L, begin + 16);
    bool seen = false;
    for (int64_t q = 0; q < Q && !seen; ++q) {
      const at::BFloat16* m = mask + q * row_stride + begin;
      if (end - begin == 16) {
        seen = _mm512_cmp_ps_mask(load16(m), _mm512_set1_ps(kMasked), _CMP_GT_OQ) != 0;
      } else {
        for (int64_t i = 0; i < end - begin && !seen; ++i) seen = static_cast<float>(m[i]) > kMasked;
      }
    }
    if (!seen) continue;
    if (!ranges.empty() && ranges.back().second == begin) {
      ranges.back().second = end;
    } else {
      ranges.emplace_back(begin, end);
    }
  }
  if (ranges.empty()) ranges.emplace_back(0, L);
  return ranges;
}

template <int D>
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                  double scale) {
  const int64_t B = query.size(0), H = query.size(1), G = query.size(2), L = key.size(2), Q = mask.size(2);
  auto out = at::empty_like(query);
  const int64_t heads = B * H, threads = at::get_num_threads();
  const auto* q = query.data_ptr<at::BFloat16>();
  const auto* k = key.data_ptr<at::BFloat16>();
  const auto* v = value.data_ptr<at::BFloat16>();
  const auto* m = mask.data_ptr<at::BFloat16>();
  const int64_t mask_batch_stride = mask.size(0) == 1 ? 0 : mask.stride(0);  // one mask for every row
  std::vector<std::vector<std::pair<int64_t, int64_t>>> seen(mask.size(0));
  int64_t longest = 1;  // the most keys a row reads
  for (int64_t b = 0; b < mask.size(0); ++b) {
    seen[b] = seen_ranges(m + b * mask.stride(0), mask.stride(2), Q, L);
    int64_t keys = 0;
    for (const auto& range : seen[b]) keys += range.second - range.first;
    longest = std::max(longest, keys);
  }
  // few heads (one row): a row's keys split into chunks, so that every thread has work; each chunk is a task
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((4 * threads + heads - 1) / heads, longest / 256));
  const int64_t chunk = (longest + chunks - 1) / chunks;
  struct Task {
    int64_t head, begin, end;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(heads + 1);  // head's tasks: [first_task[head], first_task[head + 1])
  for (int64_t head = 0; head < heads; ++head) {
    first_task[head] = tasks.size();
    for (const auto& range : seen[mask.size(0) == 1 ? 0 : head / H])
      for (int64_t begin = range.first; begin < range.second; begin += chunk)
        tasks.push_back({head, begin, std::min(range.second, begin + chunk)});
  }
  first_task[heads] = tasks.size();
  const int64_t count = tasks.size();
  std::vector<float> maxes(count * G), sums(count * G), accs(count * G * D);
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(G * chunk);
    std::vector<int32_t> probabilities(G * ((chunk + 1) / 2));  // rounded to bfloat16, in pairs
    for (int64_t t = first; t < last; ++t) {
      const int64_t head = tasks[t].head, b = head / H, h = head % H;
      attend_chunk<D>(q + head * G * D, k + b * key.stride(0) + h * key.stride(1),
                      v + b * value.stride(0) + h * value.stride(1), m + b * mask_batch_stride, mask.stride(2), G, Q,
                      tasks[t].begin, tasks[t].end, static_cast<float>(scale), scores.data(), probabilities.data(),
                      Partial{maxes.data() + t * G, sums.data() + t * G, accs.data() + t * G * D});
    }
  });
  auto* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t head = first; head < last; ++head)
      for (int64_t g = 0; g < G; ++g) {
        float most = -std::numeric_limits<float>::infinity();
        for (int64_t t = first_task[head]; t < first_task[head + 1]; ++t) most = std::max(most, maxes[t * G + g]);
        float total = 0.f, row[D] = {0.f};
        for (int64_t t = first_task[head]; t < first_task[head + 1]; ++t) {
          if (sums[t * G + g] == 0.f) continue;
          const float weight = std::exp(maxes[t * G + g] - most);
          total += weight * sums[t * G + g];
          for (int d = 0; d < D; ++d) row[d] += weight * accs[(t * G + g) * D + d];
        }
        for (int d = 0; d < D; ++d) o[(head * G + g) * D + d] = at::BFloat16(row[d] / total);
      }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const at::Tensor& mask, double scale) {
  const int64_t G = query.size(2), D = query.size(3), Q = mask.size(2);
  const bool fast = query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                    value.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBFloat16 && G <= kMaxRows &&
                    !(G >= kAmxRows && G * key.size(2) >= kAmxProducts && has_amx_tiles()) &&
                    (D == 64 || D == 128) && key.stride(3) == 1 && value.stride(3) == 1 && key.stride(2) == D &&
                    value.stride(2) == D && G % Q == 0 && key.sizes() == value.sizes() &&
                    key.size(0) == query.size(0) && key.size(1) == query.size(1) && key.size(3) == D &&
                    (mask.size(0) == 1 || mask.size(0) == query.size(0)) && mask.size(1) == 1 &&
                    mask.size(3) == key.size(2);  // other shapes: ATen broadcasts them, or says what is wrong
  if (!fast) {
    // contiguous, as the op's fake (inference/decode_attention.py) says its output is
    return at::scaled_dot_product_attention(query, key, value, mask.repeat({1, 1, G / Q, 1}), 0.0, false, scale)
        .contiguous();
  }
  const auto q = query.contiguous();
  const auto m = mask.stride(3) == 1 ? mask : mask.contiguous();
  return D == 64 ? attend<64>(q, key, value, m, scale) : attend<128>(q, key, value, m, scale);
}

}  // namespace

TORCH_LIBRARY(specheads, library) {
  library.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specheads, CPU, library) { library.impl("decode_attention", &decode_attention); }

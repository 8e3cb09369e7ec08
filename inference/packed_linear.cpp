// Linear layers of a few rows over bfloat16 (or int8) weights, on a CPU with AVX512-BF16: the ops
// `specheads::pack_linear_weight`, `specheads::quantize_int8` and `specheads::packed_linear` (built and registered by
// inference/kernels.py; graph_passes.packed_products puts them in the compiled passes). A pass over a few tokens reads
// every weight once: these read them faster than oneDNN's products do (docs/experiments.md, row X14).
//
// The weight [N, K] is packed once (a compiled graph folds the packing into its constants) into groups of 64 output
// columns, each group one contiguous stream [K/2][4][16][2]: a 64-byte load holds 16 columns' pairs of inputs, which
// AVX512-BF16's dot product multiplies with an input pair broadcast, summing in fp32 (the bias, if any, first), rounded
// to bfloat16 once at the end as oneDNN's are. Up to six rows share a tile (24 accumulators); more rows take several
// tiles, in turn over each chunk of a group's stream, so the stream is read from memory once (docs/experiments.md X16).
// An int8 weight (a draft's: half the bytes to read; quantize_int8, folded into the constants too) is packed alike,
// converted to bfloat16 pairs as it is read, and its sums scaled by each output's scale before the bias is added
// (docs/experiments.md X21).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlocks = 4;               // 16-column blocks a group
constexpr int64_t kColumns = 16 * kBlocks;  // output columns a group
constexpr int64_t kAhead = 16;               // input pairs ahead of the one read that are prefetched

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kChar) &&
                  weight.size(0) % kColumns == 0 && weight.size(1) % 2 == 0,
              "pack_linear_weight takes a bfloat16 or int8 weight [N, K] with N a multiple of ", kColumns,
              " and K even; got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.contiguous().view({N / kColumns, kBlocks, 16, K / 2, 2}).permute({0, 3, 1, 2, 4}).contiguous();
}

// 16 columns' pairs of weights of block b at wk, as bfloat16 pairs: bfloat16 weights as they are; int8 weights
// converted (exactly: |w| <= 127 fits bfloat16's 8 significant bits), their columns' scales applied to the sums
inline __m512bh weight_pairs(const at::BFloat16* wk, int b) { return (__m512bh)_mm512_loadu_si512(wk + 32 * b); }
inline __m512bh weight_pairs(const int8_t* wk, int b) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * b));
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(high, low);
}

// rows x 64 columns over input pairs [begin, end): x holds `rows` rows of input pairs (row stride ldx pairs), w one
// group's stream (bfloat16, or int8 with the group's column scales `scales`). The sums start from the bias (bfloat16
// weights) or zero when begin is 0, else from `sums` [rows][64]; scaled (int8), plus the bias (int8), they are rounded
// into `out` when `out` is given, else kept in `sums`. `ahead`: how far (in elements of w) to prefetch, 0 not.
template <int kRows, typename W>
inline void tile(const uint32_t* x, int64_t ldx, const W* w, int64_t begin, int64_t end, int64_t ahead,
                 const float* scales, const float* bias, float* sums, at::BFloat16* out, int64_t ldo) {
  const bool bias_first = bias != nullptr && scales == nullptr;  // as oneDNN sums, in bfloat16
  __m512 acc[kRows][kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    const __m512 start = bias_first ? _mm512_loadu_ps(bias + 16 * b) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][b] = begin == 0 ? start : _mm512_loadu_ps(sums + r * kColumns + 16 * b);
  }
  constexpr int kLines = 2 * kColumns * sizeof(W) / 64;  // a pair's weights: four cache lines, two in int8
  for (int64_t k = begin; k < end; ++k) {
    const W* wk = w + k * 2 * kColumns;
    if (ahead != 0)
      for (int line = 0; line < kLines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wk + ahead) + 64 * line, _MM_HINT_T0);
    __m512bh wv[kBlocks];
    for (int b = 0; b < kBlocks; ++b) wv[b] = weight_pairs(wk, b);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b) {
      if (out == nullptr) {
        _mm512_storeu_ps(sums + r * kColumns + 16 * b, acc[r][b]);
        continue;
      }
      __m512 sum = acc[r][b];
      if (scales != nullptr) sum = _mm512_mul_ps(sum, _mm512_loadu_ps(scales + 16 * b));
      if (bias != nullptr && !bias_first) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + 16 * b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * b), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

// weight [N, K] as int8 [N, K] and each output's scale [N] (float32): round(w / scale), scale = max |w| / 127
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "quantize_int8 takes a weight [outputs, inputs], got ", weight.sizes());
  const at::Tensor values = weight.to(at::kFloat);
  const at::Tensor scales = values.abs().amax(1).clamp_min(std::numeric_limits<float>::min()) / 127;
  return {(values / scales.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar), scales};
}

template <typename W>
using Tile = void (*)(const uint32_t*, int64_t, const W*, int64_t, int64_t, int64_t, const float*, const float*,
                      float*, at::BFloat16*, int64_t);
template <typename W>
constexpr Tile<W> kTiles[] = {tile<1, W>, tile<1, W>, tile<2, W>, tile<3, W>, tile<4, W>, tile<5, W>, tile<6, W>};
// input pairs every tile takes in turn: 8 KiB of a group's bfloat16 stream, 4 KiB of an int8 one
constexpr int64_t kChunk = 32;
constexpr int64_t kChunkedTiles = 4;  // with more tiles, each streams the whole group from the cache in turn

// input [..., K] times the packed weight's transpose (bfloat16, or int8 times each output's scale), plus the bias:
// [..., N] in bfloat16
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scales) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == kBlocks && packed.size(3) == 16 && packed.size(4) == 2 &&
                  (int8 || packed.scalar_type() == at::kBFloat16) && packed.is_contiguous(),
              "packed_linear takes a weight packed by pack_linear_weight");
  const int64_t groups = packed.size(0), pairs = packed.size(1), N = groups * kColumns;
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.size(-1) == 2 * pairs, "packed_linear: a bfloat16 input",
              " of ", 2 * pairs, " features was expected, got ", input.scalar_type(), " ", input.sizes());
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "packed_linear: the bias has ", bias->numel(),
              " elements for ", N, " outputs");
  TORCH_CHECK(int8 == scales.has_value(), "packed_linear: an int8 weight takes its outputs' scales, a bfloat16 none");
  TORCH_CHECK(!int8 || (scales->numel() == N && scales->scalar_type() == at::kFloat && scales->is_contiguous()),
              "packed_linear: the scales of an int8 weight are ", N, " contiguous float32 values");
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  const at::Tensor x = input.reshape({-1, 2 * pairs}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, input.options());
  if (M == 0) return out.view(sizes);
  const at::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const float* sp = int8 ? scales->data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // rows in as few tiles as six rows a tile allow, as even as possible (7 as 4 + 3, not 6 + 1: a tile of one row is
  // bound by its dot products' latency)
  const int64_t tiles = std::max<int64_t>(1, (M + 5) / 6);
  std::vector<int64_t> first_row(tiles + 1, 0);
  for (int64_t t = 0; t < tiles; ++t)
    first_row[t + 1] = first_row[t] + (M - first_row[t] + tiles - t - 1) / (tiles - t);
  const int64_t step = 2 * kColumns, chunk = tiles == 1 || tiles > kChunkedTiles ? pairs : kChunk;
  auto run = [&](const auto* wp) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
    at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
      std::vector<float> sums(6 * tiles * kColumns);  // each tile's sums between chunks
      for (int64_t g = first; g < last; ++g) {
        const W* wg = wp + g * pairs * step;
        const float* bg = bp != nullptr ? bp + g * kColumns : nullptr;
        const float* sg = sp != nullptr ? sp + g * kColumns : nullptr;
        // A group streams from memory once: each chunk is read by the first tile from memory (prefetched a little
        // ahead), then by the others from the cache, while they prefetch the next chunk, so that memory and the dot
        // products overlap.
        for (int64_t begin = 0; begin < pairs; begin += chunk) {
          const int64_t end = std::min(pairs, begin + chunk);
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t m = first_row[t], rows = first_row[t + 1] - m;
            kTiles<W>[rows](xp + m * pairs, pairs, wg, begin, end, t == 0 ? kAhead * step : t == 1 ? chunk * step : 0,
                            sg, bg, sums.data() + t * 6 * kColumns,
                            end == pairs ? op + m * N + g * kColumns : nullptr, N);
          }
        }
      }
    });
  };
  if (int8)
    run(packed.data_ptr<int8_t>());
  else
    run(packed.data_ptr<at::BFloat16>());
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specheads, library) {
  library.def("pack_linear_weight(Tensor weight) -> Tensor");
  library.def("quantize_int8(Tensor weight) -> (Tensor, Tensor)");
  library.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specheads, CPU, library) {
  library.impl("pack_linear_weight", &pack_linear_weight);
  library.impl("quantize_int8", &quantize_int8);
  library.impl("packed_linear", &packed_linear);
}

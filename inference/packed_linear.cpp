// Linear layers of a few rows over bfloat16 weights, on a CPU with AVX512-BF16: the ops `specheads::pack_linear_weight`
// and `specheads::packed_linear` (built and registered by inference/kernels.py; graph_passes.packed_products puts
// them in the compiled passes). A pass over a few tokens reads every weight once: these read them faster than oneDNN's
// products do (docs/experiments.md, row X14).
//
// The weight [N, K] is packed once (a compiled graph folds the packing into its constants) into groups of 64 output
// columns, each group one contiguous stream [K/2][4][16][2]: a 64-byte load holds 16 columns' pairs of inputs, which
// AVX512-BF16's dot product multiplies with an input pair broadcast, summing in fp32 (the bias, if any, first), rounded
// to bfloat16 once at the end as oneDNN's are. Up to six rows share a tile (24 accumulators): a group streams from
// memory for the first tile and from the cache for the next ones.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace {

constexpr int64_t kBlocks = 4;               // 16-column blocks a group
constexpr int64_t kColumns = 16 * kBlocks;  // output columns a group
constexpr int64_t kAhead = 16;               // input pairs ahead of the one read that are prefetched

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(0) % kColumns == 0 &&
                  weight.size(1) % 2 == 0,
              "pack_linear_weight takes a bfloat16 weight [N, K] with N a multiple of ", kColumns,
              " and K even; got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.contiguous().view({N / kColumns, kBlocks, 16, K / 2, 2}).permute({0, 3, 1, 2, 4}).contiguous();
}

// rows x 64 columns: x holds `rows` rows of K/2 input pairs (row stride ldx pairs), w one group's stream
template <int kRows>
inline void tile(const uint32_t* x, int64_t ldx, const at::BFloat16* w, int64_t pairs, const float* bias,
                 at::BFloat16* out, int64_t ldo) {
  __m512 acc[kRows][kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    const __m512 start = bias != nullptr ? _mm512_loadu_ps(bias + 16 * b) : _mm512_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][b] = start;
  }
  for (int64_t k = 0; k < pairs; ++k) {
    const at::BFloat16* wk = w + k * 2 * kColumns;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * 2 * kColumns), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * 2 * kColumns + 32), _MM_HINT_T0);
    __m512bh wv[kBlocks];
    for (int b = 0; b < kBlocks; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(wk + 32 * b);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      for (int b = 0; b < kBlocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int b = 0; b < kBlocks; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * b), (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

// input [..., K] times the packed weight's transpose, plus the bias: [..., N] in bfloat16
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == kBlocks && packed.size(3) == 16 && packed.size(4) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "packed_linear takes a weight packed by pack_linear_weight");
  const int64_t groups = packed.size(0), pairs = packed.size(1), N = groups * kColumns;
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.size(-1) == 2 * pairs, "packed_linear: a bfloat16 input",
              " of ", 2 * pairs, " features was expected, got ", input.scalar_type(), " ", input.sizes());
  TORCH_CHECK(!bias.has_value() || bias->numel() == N, "packed_linear: the bias has ", bias->numel(),
              " elements for ", N, " outputs");
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  const at::Tensor x = input.reshape({-1, 2 * pairs}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, input.options());
  const at::Tensor bias32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const at::BFloat16* wg = wp + g * pairs * 2 * kColumns;
      const float* bg = bp != nullptr ? bp + g * kColumns : nullptr;
      // rows in as few tiles as six rows a tile allow, as even as possible (7 as 4 + 3, not 6 + 1: a tile of
      // one row is bound by its dot products' latency)
      for (int64_t m = 0, tiles = (M + 5) / 6; m < M; --tiles) {
        const int64_t rows = (M - m + tiles - 1) / tiles;
        const uint32_t* xm = xp + m * pairs;
        at::BFloat16* om = op + m * N + g * kColumns;
        switch (rows) {
          case 6: tile<6>(xm, pairs, wg, pairs, bg, om, N); break;
          case 5: tile<5>(xm, pairs, wg, pairs, bg, om, N); break;
          case 4: tile<4>(xm, pairs, wg, pairs, bg, om, N); break;
          case 3: tile<3>(xm, pairs, wg, pairs, bg, om, N); break;
          case 2: tile<2>(xm, pairs, wg, pairs, bg, om, N); break;
          default: tile<1>(xm, pairs, wg, pairs, bg, om, N);
        }
        m += rows;
      }
    }
  });
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specheads, library) {
  library.def("pack_linear_weight(Tensor weight) -> Tensor");
  library.def("packed_linear(Tensor input, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(specheads, CPU, library) {
  library.impl("pack_linear_weight", &pack_linear_weight);
  library.impl("packed_linear", &packed_linear);
}

// Few-row float32 matmul against a panel-packed weight, for XLA:CPU (an XLA FFI handler).
//
// y[t, o] = sum_i x[t, i] * w[i, o], with w packed once per target into panels [P, I, 64] (panel p
// holds columns 64p..64p+63, row i of the panel contiguous); rows go in groups (<= 8) through each
// panel while it is in cache.
// Each output is one fused multiply-add chain over i ascending, the same for every row whatever
// T is: a row of a T-row verification equals the same row decoded alone, bit for bit.
// Why: XLA:CPU's dot kernels cost ~2.3x a 1-row product at 4 rows on two cores (the packing and
// tiling of skinny GEMMs); this one streams each weight once with T x NV accumulators in registers
// and prefetches ahead, so 4 rows cost ~1.15x one row. Built on first use by
// confu_jax/kernels/cpu_matmul.py.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
constexpr int VL = 16, REGS = 32;  // 32 zmm: 8 rows x 4 vectors spill a little, and still beat 2 passes
#elif defined(__AVX__)
constexpr int VL = 8, REGS = 8;    // 16 ymm
#else
constexpr int VL = 4, REGS = 8;
#endif
constexpr int64_t PANEL = 64;      // columns per packed panel (cpu_matmul.PANEL)
// Software prefetch distance, in panel rows (16 x 256 B = 4 KiB ahead). The hardware prefetchers
// alone left a 4-row product 1.33x a 1-row one (the extra FMAs shrink how far ahead the core runs);
// with this, 1.15x (SmolLM2's weights, Intel Xeon, two cores; docs/RESULTS.md).
constexpr int64_t PREFETCH_ROWS = 16;
// Rows per group when there are more than 8 (prefill): 6 rows x 4 vectors fit the registers; 8 spill
// (a 128-token SmolLM2 prefill: 211 ms against 221 ms; XLA's GEMM 186 ms).
constexpr int64_t GROUP_LARGE = 6;
constexpr int PANEL_VECS = PANEL / VL;
typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof(vf)); return v; }
static inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

// Columns [c0, c0 + NV*VL) of one panel for T rows.
template <int T, int NV>
static void block(const float* x, int64_t I, const float* panel, int64_t c0, float* y, int64_t ldy) {
  vf acc[T][NV];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = vf{};
  const float* wp = panel + c0;
  for (int64_t i = 0; i < I; ++i, wp += PANEL) {
    for (int l = 0; l < NV * VL; l += 16) __builtin_prefetch(wp + PREFETCH_ROWS * PANEL + l);  // never faults
    vf wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(wp + v * VL);
    for (int t = 0; t < T; ++t) {
      vf xb = vf{} + x[t * I + i];
      for (int v = 0; v < NV; ++v) acc[t][v] += xb * wv[v];  // contracted to an FMA (-ffp-contract=fast)
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < NV; ++v) store(y + t * ldy + c0 + v * VL, acc[t][v]);
}

template <int T>
static void panels(const float* x, int64_t I, const float* w, int64_t p0, int64_t p1, float* y, int64_t ldy) {
  constexpr int want = REGS / T > 0 ? REGS / T : 1;
  constexpr int NV = want >= 4 && PANEL_VECS % 4 == 0 ? 4 : (want >= 2 && PANEL_VECS % 2 == 0 ? 2 : 1);
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t c = 0; c < PANEL; c += NV * VL) block<T, NV>(x, I, w + p * I * PANEL, c, y + p * PANEL, ldy);
}

static void run_rows(int64_t rows, const float* x, int64_t I, const float* w, int64_t p0, int64_t p1, float* y,
                     int64_t ldy) {
  switch (rows) {
    case 1: return panels<1>(x, I, w, p0, p1, y, ldy);
    case 2: return panels<2>(x, I, w, p0, p1, y, ldy);
    case 3: return panels<3>(x, I, w, p0, p1, y, ldy);
    case 4: return panels<4>(x, I, w, p0, p1, y, ldy);
    case 5: return panels<5>(x, I, w, p0, p1, y, ldy);
    case 6: return panels<6>(x, I, w, p0, p1, y, ldy);
    case 7: return panels<7>(x, I, w, p0, p1, y, ldy);
    default: return panels<8>(x, I, w, p0, p1, y, ldy);
  }
}

// Work units (a range of panels, every row group through each panel while it is in cache) claimed
// from a counter by the calling thread and by helpers on XLA's intra-op pool; the caller waits only
// for units a helper claimed, so a helper that starts late (its thread busy with another thunk)
// finds nothing and costs nothing.
struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t T, I, P, units, G;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      for (int64_t p = u * P / units, p1 = (u + 1) * P / units; p < p1; ++p)
        for (int64_t r = 0; r < T; r += G)
          run_rows(std::min<int64_t>(G, T - r), x + r * I, I, w, p, p + 1, y + r * P * PANEL, P * PANEL);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                               ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != PANEL)
    return ffi::Error::InvalidArgument("packed weight must be [P, I, 64]");
  const int64_t P = wd[0], I = wd[1];
  auto xd = x.dimensions();
  if (xd.size() < 1 || xd[xd.size() - 1] != I)
    return ffi::Error::InvalidArgument("x's last dimension must equal the packed weight's I");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->T = static_cast<int64_t>(x.element_count()) / I;
  job->I = I;
  job->P = P;
  job->G = job->T <= 8 ? 8 : GROUP_LARGE;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Small products: one unit (a split costs more than it saves).
  job->units = P * I * PANEL * 4 * ((job->T + 7) / 8) < (256 << 10) ? 1 : std::min<int64_t>(P, 4 * threads);
  const int64_t helpers = std::min<int64_t>(threads, job->units) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->units) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConfuPackedMatmulF32, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// What the AMX bf16 tiles can do on this core, and what a chunked GEMM loop's accumulator round trip costs
// (docs/performance/intel-amx.md). Linux, a CPU with amx_bf16; one thread:
//   g++ -O2 -march=native -mamx-tile -mamx-bf16 tools/amx_tile_probe.cpp -o /tmp/amx_tile_probe && /tmp/amx_tile_probe
// Every operand sits in L1, so the figures are the loop's own limits, not memory's.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

alignas(64) static uint16_t A[16 * 1024], B[32 * 1024];
alignas(64) static float C[16 * 1024];
constexpr long kIters = 200000;

template <typename F>
double tflops(long products, F body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return products * 16.0 * 16 * 32 * 2 / s / 1e12;  // one TDPBF16PS: 16 x 16 outputs x 32 k
}

// One 16-row tile x a 64-output block (four accumulators), `steps` steps of 32 k: per step one x tile and
// four weight tiles (the kernel's 256-byte weight rows), the accumulators loaded and stored around the chunk
// when `round_trip`.
void chunk(float* c, int steps, bool round_trip) {
  if (round_trip) {
    _tile_loadd(0, c, 256); _tile_loadd(1, c + 16, 256); _tile_loadd(2, c + 32, 256); _tile_loadd(3, c + 48, 256);
  }
  for (int s = 0; s < steps; ++s) {
    const uint16_t* w = B + (s & 7) * 2048;
    _tile_loadd(4, A + (s & 15) * 512, 64);
    _tile_loadd(5, w, 256); _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 32, 256); _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w + 64, 256); _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, w + 96, 256); _tile_dpbf16ps(3, 4, 6);
  }
  if (round_trip) {
    _tile_stored(0, c, 256); _tile_stored(1, c + 16, 256); _tile_stored(2, c + 32, 256); _tile_stored(3, c + 48, 256);
  }
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::puts("this process may not use the AMX tiles");
    return 1;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  for (auto& v : A) v = 0x3c00;
  for (auto& v : B) v = 0x3c00;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, A, 64); _tile_loadd(5, A + 512, 64); _tile_loadd(6, B, 64); _tile_loadd(7, B + 512, 64);
  const long n = 50 * kIters;
  std::printf("products only, tiles in registers: %.2f TFLOP/s\n", tflops(4 * n, [&] {
    for (long i = 0; i < n; ++i) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
  }));
  for (int steps : {8, 16, 28}) {
    std::printf("1 x 4 tiles, accumulators stored and reloaded every %2d steps: %.2f TFLOP/s\n", steps,
                tflops(4L * steps * kIters, [&] { for (long i = 0; i < kIters; ++i) chunk(C + (i & 15) * 1024, steps, true); }));
  }
  std::printf("1 x 4 tiles, accumulators kept in the tiles: %.2f TFLOP/s\n",
              tflops(4L * 8 * kIters, [&] { for (long i = 0; i < kIters; ++i) chunk(C, 8, false); }));
  _tile_stored(0, C, 64);
  return C[0] == 12345.f;  // (keeps the products live)
}

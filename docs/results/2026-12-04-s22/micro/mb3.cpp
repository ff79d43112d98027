#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
static void cfg(){ alignas(64) uint8_t c[64]={}; c[0]=1; for(int t=0;t<8;++t){c[16+2*t]=64;c[48+t]=16;} _tile_loadconfig(c);}
double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
int main(int argc, char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18); cfg();
  const int K = 576, M = 64, P = argc > 1 ? atoi(argv[1]) : 32;  // panels
  const int order = argc > 2 ? atoi(argv[2]) : 0;
  uint16_t* A = (uint16_t*)aligned_alloc(4096, M*K*2); for(int i=0;i<M*K;++i) A[i]=0x3f80;
  size_t wb = (size_t)P*32*K*2;
  uint16_t* W = (uint16_t*)aligned_alloc(4096, wb); for(size_t i=0;i<wb/2;++i) W[i]=0x3f80;
  alignas(64) float c[32*32];
  const int steps = K/32, reps = 2000000 / (P*steps*8);
  double t0=now();
  for (int rep=0; rep<reps; ++rep) {
   if (order == 0) {
    for (int p=0;p<P;++p) for (int r=0;r<M;r+=32) {
      const uint16_t* panel = W + (size_t)p*steps*1024; const uint16_t* xr = A + r*K;
      _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
      for (int s=0;s<steps;++s){ const uint16_t* b = panel + s*1024;
        _tile_loadd(0, xr + s*32, K*2); _tile_loadd(1, xr + 16*K + s*32, K*2);
        _tile_loadd(2, b, 64); _tile_loadd(3, b+512, 64);
        _tile_dpbf16ps(4,0,2); _tile_dpbf16ps(5,0,3); _tile_dpbf16ps(6,1,2); _tile_dpbf16ps(7,1,3);}
      _tile_stored(4, c, 128); _tile_stored(5, c+16, 128); _tile_stored(6, c+512, 128); _tile_stored(7, c+528, 128);
    }
   } else {  // groups of G panels, A pass L1-resident
    const int G = 8;
    for (int g=0; g<P; g+=G) for (int r=0;r<M;r+=32) for (int p=g;p<g+G && p<P;++p) {
      const uint16_t* panel = W + (size_t)p*steps*1024; const uint16_t* xr = A + r*K;
      _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
      for (int s=0;s<steps;++s){ const uint16_t* b = panel + s*1024;
        _tile_loadd(0, xr + s*32, K*2); _tile_loadd(1, xr + 16*K + s*32, K*2);
        _tile_loadd(2, b, 64); _tile_loadd(3, b+512, 64);
        _tile_dpbf16ps(4,0,2); _tile_dpbf16ps(5,0,3); _tile_dpbf16ps(6,1,2); _tile_dpbf16ps(7,1,3);}
      _tile_stored(4, c, 128); _tile_stored(5, c+16, 128); _tile_stored(6, c+512, 128); _tile_stored(7, c+528, 128);
    }
   }
  }
  double t1=now();
  double ntdp = (double)reps*P*(M/32)*steps*4;
  printf("P=%d (%.0f KB) order %d: %.2f ns per tdp, %.1f GB/s of weights\n", P, wb/1024., order, (t1-t0)/ntdp*1e9, wb*reps/(t1-t0)/1e9);
  _tile_release();
}

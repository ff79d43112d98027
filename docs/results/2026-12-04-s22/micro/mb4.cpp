#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <omp.h>
static void cfg(){ alignas(64) uint8_t c[64]={}; c[0]=1; for(int t=0;t<8;++t){c[16+2*t]=64;c[48+t]=16;} _tile_loadconfig(c);}
double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
int main(int argc, char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int K = 576, M = 64, P = 4096;
  const int mode = atoi(argv[1]); const long D = atol(argv[2]); const int lines = argc>3? atoi(argv[3]) : 32;
  uint16_t* A = (uint16_t*)aligned_alloc(4096, M*K*2); for(int i=0;i<M*K;++i) A[i]=0x3f80;
  size_t wb = (size_t)P*32*K*2;
  uint16_t* W = (uint16_t*)aligned_alloc(4096, wb); for(size_t i=0;i<wb/2;++i) W[i]=0x3f80;
  const int steps = K/32;
  double best = 1e9;
  for (int it=0; it<3; ++it) {
  double t0=now();
#pragma omp parallel
  {
    cfg();
    alignas(64) float c[32*32];
    int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    int p0 = P*tid/nt, p1 = P*(tid+1)/nt;
    if (mode == 9) { __m512 acc=_mm512_setzero_ps(); const float* f=(const float*)(W + (size_t)p0*steps*1024); size_t n=(size_t)(p1-p0)*steps*1024/2;
      for (size_t i=0;i<n;i+=16) acc=_mm512_add_ps(acc,_mm512_load_ps(f+i)); c[0]=acc[0]; }
    else if (mode == 8) { for (int p=p0;p<p1;++p) for (int s=0;s<steps;++s){ const uint16_t* b = W + (size_t)p*steps*1024 + s*1024; _tile_loadd(2, b, 64); _tile_loadd(3, b+512, 64);} }
    else
    for (int p=p0;p<p1;++p) for (int r=0;r<M;r+=32) {
      const uint16_t* panel = W + (size_t)p*steps*1024; const uint16_t* xr = A + r*K;
      _tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
      for (int s=0;s<steps;++s){ const uint16_t* b = panel + s*1024;
        if (r == 32 && (mode == 6 || mode == 7 || mode == 10)) {
          const char* pf = (const char*)(panel + steps*1024) + s*2048 + D;
          if (mode == 6) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T2);
          if (mode == 7) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T0);
          if (mode == 10) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T1);
        }
        if (r == 0) {
          const char* pf = (const char*)b + D;
          if (mode == 1) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T0);
          if (mode == 2) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T1);
          if (mode == 3) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_T2);
          if (mode == 4) for (int i=0;i<lines;++i) _mm_prefetch(pf + 64*i, _MM_HINT_NTA);
          if (mode == 5) for (int i=0;i<lines;i+=2) _mm_prefetch(pf + 64*i, _MM_HINT_T0);
        }
        _tile_loadd(0, xr + s*32, K*2); _tile_loadd(1, xr + 16*K + s*32, K*2);
        _tile_loadd(2, b, 64); _tile_loadd(3, b+512, 64);
        _tile_dpbf16ps(4,0,2); _tile_dpbf16ps(5,0,3); _tile_dpbf16ps(6,1,2); _tile_dpbf16ps(7,1,3);}
      _tile_stored(4, c, 128); _tile_stored(5, c+16, 128); _tile_stored(6, c+512, 128); _tile_stored(7, c+528, 128);
    }
    _tile_release();
  }
  double t1=now(); if (t1-t0 < best) best = t1-t0;
  }
  printf("mode %d D %ld: %.1f GB/s\n", mode, D, wb/best/1e9);
}

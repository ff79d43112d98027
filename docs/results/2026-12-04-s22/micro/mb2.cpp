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
  long r = syscall(SYS_arch_prctl, 0x1023, 18); cfg();
  int off = argc>1? atoi(argv[1]):0;
  uint16_t* buf = (uint16_t*)aligned_alloc(4096, 4<<20); for(int i=0;i<(2<<20);++i) buf[i]=0x3f80;
  buf += off;
  const int N=1000000;
  double t0=now();
  for(int i=0;i<N;++i){ const uint16_t* b = buf + (i&7)*2048;
    _tile_loadd(0, b, 64); _tile_loadd(1, b+512, 64); _tile_loadd(2, b+1024, 64); _tile_loadd(3, b+1536, 64);}
  double t1=now(); printf("off %d: contiguous 4 loads(L1): %.2f ns per load\n", off, (t1-t0)/N/4*1e9);
  t0=now();
  for(int i=0;i<N;++i){ const uint16_t* b = buf;
    _tile_loadd(0, b, 64); _tile_loadd(1, b, 64); _tile_loadd(2, b, 64); _tile_loadd(3, b, 64);}
  t1=now(); printf("same tile 4 loads: %.2f ns per load\n", (t1-t0)/N/4*1e9);
  t0=now();
  for(int i=0;i<N;++i){ const uint16_t* b = buf + (i&7)*2048;
    _tile_loadd(0, b, 64); _tile_loadd(1, b+512, 64); _tile_loadd(2, b+1024, 64); _tile_loadd(3, b+1536, 64);
    _tile_dpbf16ps(4,0,2); _tile_dpbf16ps(5,0,3); _tile_dpbf16ps(6,1,2); _tile_dpbf16ps(7,1,3);}
  t1=now(); printf("4 loads + 4 tdp: %.2f ns per tdp\n", (t1-t0)/N/4*1e9);
  __m512 acc = _mm512_setzero_ps();
  t0=now();
  for(int i=0;i<N;++i){ const uint16_t* b = buf + (i&7)*2048;
    for (int j=0;j<64;++j) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(b+32*j)));}
  t1=now(); printf("zmm loads 4KB: %.2f ns per KB (%g)\n", (t1-t0)/N/4*1e9, acc[0]);
  _tile_release();
}

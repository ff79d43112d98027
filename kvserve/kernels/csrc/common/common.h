// Shared includes of the kvserve CPU kernels, and which vector path this build compiled.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#define KVSERVE_SIMD "avx512"
#elif defined(__AVX2__)
#define KVSERVE_SIMD "avx2"
#else
#define KVSERVE_SIMD "scalar"
#endif

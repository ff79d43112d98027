// KVSERVE_INLINE: a helper carved out of a hot kernel, inlined back into it whatever the compiler's
// heuristics say, so the kernel compiles as one body, as it did before it was cut into named steps.
#pragma once

#define KVSERVE_INLINE inline __attribute__((always_inline))

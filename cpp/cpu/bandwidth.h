#pragma once
#include <cstddef>

namespace metalattn::cpu {

// Bytes per second that n_threads (0: all physical cores) read from a buffer of `bytes` (far larger than the
// caches), best of `repeats` passes after one warm-up pass.
double measure_read_bandwidth(int n_threads, size_t bytes, int repeats);

}  // namespace metalattn::cpu

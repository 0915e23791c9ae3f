// Counter-based random numbers: every value is a pure function of (seed, key, index), so parameter
// initialisation does not depend on the order of calls, the thread count or the parallel layout.
// A rank that holds a slice of a tensor draws exactly the values the whole tensor would have.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace moetron {

// SplitMix64 finaliser: a bijective 64-bit mixer with good avalanche.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a over the bytes of a name, then mixed: the per-tensor stream key.
inline uint64_t hash_name(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ULL;
  return mix64(h);
}

// Uniform in (0, 1): 53 random bits, never exactly 0.
inline double uniform_at(uint64_t seed, uint64_t key, uint64_t index, uint64_t lane) {
  const uint64_t r = mix64(mix64(seed ^ key) + mix64(index * 2 + lane));
  return ((double)(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Standard normal at (seed, key, index) by Box-Muller on two independent uniforms.
inline double normal_at(uint64_t seed, uint64_t key, uint64_t index) {
  const double u1 = uniform_at(seed, key, index, 0);
  const double u2 = uniform_at(seed, key, index, 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace moetron

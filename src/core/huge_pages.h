// An allocator for large buffers read whole and often (weights quantized at load): from 2 MiB of
// elements on, an anonymous mapping aligned to 2 MiB with the kernel asked for 2 MiB pages
// (madvise MADV_HUGEPAGE) before its first write, so streaming it misses the TLB once per 2 MiB
// rather than per 4 KiB; smaller ones from operator new.  Where the kernel gives no 2 MiB pages
// (transparent huge pages off) the mapping is plain memory.  std::vector<T, HugePageAllocator<T>>
// still value-initializes: the zeroing is the first write, after the advice.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace moetron {

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHugePage = size_t{2} << 20;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return static_cast<T*>(::operator new (bytes, std::align_val_t{alignof(T)}));
    // Over-mapped by one page's worth and trimmed, so the buffer starts on a 2 MiB boundary.
    const size_t mapped = round_up(bytes) + kHugePage;
    void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p), start = (raw + kHugePage - 1) / kHugePage * kHugePage;
    if (start > raw) ::munmap(p, start - raw);
    if (const uintptr_t end = start + round_up(bytes); end < raw + mapped)
      ::munmap(reinterpret_cast<void*>(end), raw + mapped - end);
    (void)::madvise(reinterpret_cast<void*>(start), round_up(bytes), MADV_HUGEPAGE);  // advice only
    return reinterpret_cast<T*>(start);
  }

  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage)
      ::operator delete (p, std::align_val_t{alignof(T)});
    else
      ::munmap(p, round_up(bytes));
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }

 private:
  static size_t round_up(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
};

template <typename T>
using HugeVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace moetron

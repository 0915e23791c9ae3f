// An allocator for large buffers read whole and often (weights quantized at load): a buffer of 2 MiB
// or more is an anonymous mapping aligned to 2 MiB with the kernel asked for 2 MiB pages
// (madvise MADV_HUGEPAGE) before its first write, so streaming it misses the TLB once per 2 MiB
// rather than per 4 KiB; smaller ones from operator new.  Where the kernel gives no 2 MiB pages
// (transparent huge pages off) the mapping is plain memory.  std::vector<T, HugePageAllocator<T>>
// still value-initializes: the zeroing is the first write, after the advice.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace moetron {

// The size of an x86-64 transparent huge page (a PMD mapping), here and in core/mmap.
inline constexpr size_t kHugePageBytes = size_t{2} << 20;

template <typename T>
struct HugePageAllocator {
  using value_type = T;

  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes) return static_cast<T*>(::operator new (bytes, std::align_val_t{alignof(T)}));
    // Over-mapped by 2 MiB and trimmed, so the buffer starts on a 2 MiB boundary.  Only its whole
    // 2 MiB windows are advised: a partial last one stays in 4 KiB pages, so the resident bytes are
    // the buffer's, not rounded up to 2 MiB (a 30 MB Q8_0 model would hold up to 4 MiB more).
    const size_t mapped = pages(bytes) + kHugePageBytes;
    void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t raw = reinterpret_cast<uintptr_t>(p),
                    start = (raw + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (start > raw) ::munmap(p, start - raw);
    if (const uintptr_t end = start + pages(bytes); end < raw + mapped)
      ::munmap(reinterpret_cast<void*>(end), raw + mapped - end);
    (void)::madvise(reinterpret_cast<void*>(start), bytes / kHugePageBytes * kHugePageBytes,
                    MADV_HUGEPAGE);  // advice only
    return reinterpret_cast<T*>(start);
  }

  void deallocate(T* p, size_t n) noexcept {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePageBytes)
      ::operator delete (p, std::align_val_t{alignof(T)});
    else
      ::munmap(p, pages(bytes));
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }

 private:
  static size_t pages(size_t bytes) {  // rounded up to the mapping's granularity
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return (bytes + page - 1) / page * page;
  }
};

template <typename T>
using HugeVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace moetron

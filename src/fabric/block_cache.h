// Memory for the engine's per-operation objects (OpState with its reference
// counts, one std::allocate_shared block per operation): freed blocks are
// kept in a small per-thread list and handed out again, instead of a round
// trip through malloc and free for every write (about 130 instructions of
// the engine's per-write cost on glibc, tcache included).
//
// A block freed on another thread than the one that took it (an operation
// completed and dropped by the worker) goes to that thread's list: lists
// only hold blocks, never own particular ones. At most kBlocksPerThread are
// kept per thread and size; the rest, and every block freed after a
// thread's list was destroyed at its exit, go back to operator delete.
#pragma once

#include <cstddef>
#include <new>

namespace moelink::fabric {

template <size_t Size, size_t Align>
class BlockCache {
 public:
  static constexpr int kBlocksPerThread = 64;

  static void* take() {
    if (!dead_) {
      List& l = list();
      if (l.head) {
        Block* b = l.head;
        l.head = b->next;
        --l.count;
        return b;
      }
    }
    return ::operator new(Size, std::align_val_t{Align});
  }
  static void give(void* p) {
    if (!dead_) {
      List& l = list();
      if (l.count < kBlocksPerThread) {
        l.head = new (p) Block{l.head};
        ++l.count;
        return;
      }
    }
    ::operator delete(p, std::align_val_t{Align});
  }

 private:
  struct Block {
    Block* next;
  };
  static_assert(Size >= sizeof(Block) && Align >= alignof(Block));
  struct List {
    Block* head = nullptr;
    int count = 0;
    ~List() {
      dead_ = true;  // frees later in this thread's exit go to operator delete
      while (head) {
        Block* b = head;
        head = b->next;
        ::operator delete(b, std::align_val_t{Align});
      }
    }
  };
  static List& list() {
    thread_local List l;
    return l;
  }
  // Trivially destructible, so still readable after List's destructor ran.
  static inline thread_local bool dead_ = false;
};

// A std::allocator for std::allocate_shared that takes single objects from
// BlockCache (arrays, never asked for by allocate_shared, from operator new).
template <class T>
struct CachedAllocator {
  using value_type = T;
  CachedAllocator() = default;
  template <class U>
  CachedAllocator(const CachedAllocator<U>&) {}
  T* allocate(size_t n) {
    if (n == 1) return static_cast<T*>(BlockCache<sizeof(T), alignof(T)>::take());
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{alignof(T)}));
  }
  void deallocate(T* p, size_t n) {
    if (n == 1)
      BlockCache<sizeof(T), alignof(T)>::give(p);
    else
      ::operator delete(p, std::align_val_t{alignof(T)});
  }
  template <class U>
  bool operator==(const CachedAllocator<U>&) const {
    return true;
  }
};

}  // namespace moelink::fabric

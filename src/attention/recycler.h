// Internal: the parts of the histories a cache hands back on every step (a paged sequence's
// columns, a batch's rows), made again and again without allocating once warm.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "kvsnap/attention.h"

namespace kvsnap::detail {

// Objects of type T handed out as shared_ptr<const T> that come back when their last holder
// lets go — in any thread, even after the recycler is gone — with their members' memory (a
// vector's capacity) kept and their references let go (`scrub`). The shared_ptr's control block
// and the object lie in one piece of memory that comes back too. So a stream of them, each let go
// before the one after the next is made (a decode step's history, dropped by the next step),
// allocates nothing once warm; more outstanding at once take more pieces, kept for reuse.
template <class T>
class Recycler {
 public:
  using Scrub = void (*)(T&);
  explicit Recycler(Scrub scrub) : state_(std::make_shared<State>(scrub)) {}

  // A T that `fill(T&)` sets (a kept one when any, its references already let go). Its memory
  // is taken before fill runs: a fill that changes state (a cache's rows written) is not undone
  // by running out here. Throws what fill throws (the T goes back), or std::bad_alloc.
  template <class Fill>
  std::shared_ptr<const T> make(Fill&& fill) {
    auto holder = std::allocate_shared<Holder>(Pieces<Holder>(state_), state_, state_->take());
    fill(holder->value);
    return std::shared_ptr<const T>(holder, &holder->value);
  }

 private:
  struct State {
    explicit State(Scrub s) : scrub(s) {}
    ~State() {
      for (void* piece : pieces) ::operator delete(piece);
    }
    T take() {
      const std::lock_guard<std::mutex> hold(mutex);
      if (kept.empty()) return T{};
      T value = std::move(kept.back());
      kept.pop_back();
      return value;
    }
    // Never throws: a value that finds no room goes (kept.push_back may grow the vector).
    void keep(T&& value) noexcept {
      scrub(value);
      const std::lock_guard<std::mutex> hold(mutex);
      try {
        kept.push_back(std::move(value));
      } catch (...) {  // out of memory: it is destroyed instead
      }
    }
    void* piece(size_t bytes) {
      {
        const std::lock_guard<std::mutex> hold(mutex);
        if (bytes == piece_bytes && !pieces.empty()) {
          void* p = pieces.back();
          pieces.pop_back();
          return p;
        }
      }
      return ::operator new(bytes);
    }
    void give_back(void* p, size_t bytes) noexcept {
      const std::lock_guard<std::mutex> hold(mutex);
      if (piece_bytes == 0) piece_bytes = bytes;
      if (bytes == piece_bytes) {
        try {
          pieces.push_back(p);
          return;
        } catch (...) {  // out of memory: freed instead
        }
      }
      ::operator delete(p);
    }

    const Scrub scrub;
    std::mutex mutex;
    std::vector<T> kept;
    std::vector<void*> pieces;
    size_t piece_bytes = 0;
  };

  // The object, which goes back to the recycler when its last holder lets go.
  struct Holder {
    Holder(std::shared_ptr<State> s, T v) : state(std::move(s)), value(std::move(v)) {}
    ~Holder() { state->keep(std::move(value)); }
    Holder(const Holder&) = delete;
    Holder& operator=(const Holder&) = delete;
    std::shared_ptr<State> state;
    T value;
  };

  // The allocator of the control block (with the Holder in it): pieces of one size, kept.
  template <class U>
  struct Pieces {
    using value_type = U;
    explicit Pieces(std::shared_ptr<State> s) : state(std::move(s)) {}
    // Copied, never emptied by a move: a moved-from allocator still equals its source.
    Pieces(const Pieces& other) noexcept : state(other.state) {}
    template <class V>
    Pieces(const Pieces<V>& other) noexcept : state(other.state) {}  // NOLINT: rebinding
    U* allocate(size_t n) { return static_cast<U*>(state->piece(n * sizeof(U))); }
    void deallocate(U* p, size_t n) noexcept { state->give_back(p, n * sizeof(U)); }
    template <class V>
    bool operator==(const Pieces<V>& other) const {
      return state == other.state;
    }
    std::shared_ptr<State> state;
  };

  std::shared_ptr<State> state_;
};

// The histories' parts made by a cache, taken as they are (a cache's columns and rows are right by
// construction: no check, no copy).
struct HistoryParts {
  static KVHistory paged(std::shared_ptr<const PagedColumns> columns) {
    KVHistory history;
    history.paged_ = std::move(columns);
    return history;
  }
  static KVHistory rows(std::shared_ptr<const std::vector<KVHistory>> rows) {
    KVHistory history;
    history.rows_ = std::move(rows);
    return history;
  }
  static RecurrentHistory rows(std::shared_ptr<const std::vector<RecurrentHistory>> rows) {
    RecurrentHistory history;
    history.rows_ = std::move(rows);
    return history;
  }
};

}  // namespace kvsnap::detail

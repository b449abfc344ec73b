// Internal: lazy snapshots and the intrusive list a cache keeps of those naming its slots.
//
// A lazy snapshot is in exactly one list while it names live slots; the cache materializes it
// (copies its slots out and unlinks it) before overwriting or freeing them, and the snapshot
// unlinks itself when destroyed first. Linking and unlinking allocate nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "kvsnap/cache.h"

namespace kvsnap::detail {

class LazyList;

class LazySnapshot : public Snapshot {
 public:
  ~LazySnapshot() override;

  void set_materialize_hook(std::function<void(int64_t)> hook) override { hook_ = std::move(hook); }
  bool is_lazy() const override { return list_ != nullptr; }

  // Runs the hook once with `delta` (the bytes now owned) and drops it. Hooks must not throw.
  void fire_materialize_hook(int64_t delta) {
    if (!hook_) return;
    auto hook = std::move(hook_);
    hook_ = nullptr;
    hook(delta);
  }
  void clear_materialize_hook() { hook_ = nullptr; }

 private:
  friend class LazyList;
  LazyList* list_ = nullptr;
  LazySnapshot* previous_ = nullptr;
  LazySnapshot* next_ = nullptr;
  std::function<void(int64_t)> hook_;
};

class LazyList {
 public:
  LazyList() = default;
  LazyList(const LazyList&) = delete;
  LazyList& operator=(const LazyList&) = delete;
  ~LazyList() { clear(); }

  void push(LazySnapshot* snapshot) noexcept {
    snapshot->list_ = this;
    snapshot->previous_ = nullptr;
    snapshot->next_ = head_;
    if (head_ != nullptr) head_->previous_ = snapshot;
    head_ = snapshot;
  }
  void remove(LazySnapshot* snapshot) noexcept {
    if (snapshot->previous_ != nullptr) snapshot->previous_->next_ = snapshot->next_;
    if (snapshot->next_ != nullptr) snapshot->next_->previous_ = snapshot->previous_;
    if (head_ == snapshot) head_ = snapshot->next_;
    snapshot->list_ = nullptr;
    snapshot->previous_ = snapshot->next_ = nullptr;
  }
  bool empty() const { return head_ == nullptr; }

  // Calls visit(snapshot) for each member; visit may remove the one it is given.
  template <class Visit>
  void for_each(Visit&& visit) {
    for (LazySnapshot* s = head_; s != nullptr;) {
      LazySnapshot* next = s->next_;
      visit(*s);
      s = next;
    }
  }

  // Unlinks every member (used only when their data has been copied out).
  void clear() noexcept {
    while (head_ != nullptr) remove(head_);
  }

 private:
  LazySnapshot* head_ = nullptr;
};

inline LazySnapshot::~LazySnapshot() {
  if (list_ != nullptr) list_->remove(this);
}

}  // namespace kvsnap::detail

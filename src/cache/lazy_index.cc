#include "cache/lazy_index.h"

#include <algorithm>
#include <functional>

namespace kvsnap::detail {

bool LazyIndex::before(const Piece* a, const Piece* b) {
  if (a->lazy_begin() != b->lazy_begin()) return a->lazy_begin() < b->lazy_begin();
  return std::less<const Piece*>()(a, b);  // equal starts: any fixed order
}

namespace {
// The piece's own lazy columns when it has no storage yet (a write would allocate for them).
int64_t own_unbacked(const Piece& piece) {
  return piece.keys.empty() ? piece.lazy_end() - piece.lazy_begin() : 0;
}
}  // namespace

void LazyIndex::update(Piece* node) {
  node->max_end = node->lazy_end();
  node->unbacked = own_unbacked(*node);
  for (const Piece* child : {node->left, node->right}) {
    if (child == nullptr) continue;
    node->max_end = std::max(node->max_end, child->max_end);
    node->unbacked += child->unbacked;
  }
}

Piece* LazyIndex::merge(Piece* a, Piece* b) {
  if (a == nullptr) return b;
  if (b == nullptr) return a;
  if (a->priority > b->priority) {
    a->right = merge(a->right, b);
    update(a);
    return a;
  }
  b->left = merge(a, b->left);
  update(b);
  return b;
}

void LazyIndex::split(Piece* node, const Piece* key, Piece*& low, Piece*& high) {
  if (node == nullptr) {
    low = high = nullptr;
    return;
  }
  if (before(node, key)) {
    split(node->right, key, node->right, high);
    low = node;
  } else {
    split(node->left, key, low, node->left);
    high = node;
  }
  update(node);
}

void LazyIndex::insert(Piece* piece) {
  // splitmix64 of a counter: priorities independent of the keys keep the treap balanced.
  uint64_t z = (seed_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  piece->priority = z ^ (z >> 31);
  piece->left = piece->right = nullptr;
  update(piece);
  Piece *low = nullptr, *high = nullptr;
  split(root_, piece, low, high);
  root_ = merge(merge(low, piece), high);
  piece->indexed = true;
}

Piece* LazyIndex::erase(Piece* node, Piece* piece) {
  if (node == piece) return merge(node->left, node->right);
  if (before(piece, node)) {
    node->left = erase(node->left, piece);
  } else {
    node->right = erase(node->right, piece);
  }
  update(node);
  return node;
}

void LazyIndex::erase(Piece* piece) {
  root_ = erase(root_, piece);
  piece->left = piece->right = nullptr;
  piece->indexed = false;
}

void LazyIndex::collect(Piece* node, int64_t from, int64_t to, std::vector<Piece*>& out) {
  // Subtrees whose lazy columns all end at or before `from` hold nothing that overlaps.
  if (node == nullptr || node->max_end <= from) return;
  collect(node->left, from, to, out);
  if (node->lazy_begin() >= to) return;  // it and its right subtree start at or after `to`
  if (node->lazy_end() > from) out.push_back(node);
  collect(node->right, from, to, out);
}

int64_t LazyIndex::unbacked_from(const Piece* node, int64_t from) {
  if (node == nullptr || node->max_end <= from) return 0;
  if (node->lazy_begin() >= from) {  // it and its right subtree lie wholly from `from` on
    return own_unbacked(*node) + (node->right != nullptr ? node->right->unbacked : 0) +
           unbacked_from(node->left, from);
  }
  const int64_t own = node->keys.empty() ? std::max<int64_t>(0, node->lazy_end() - from) : 0;
  return own + unbacked_from(node->left, from) + unbacked_from(node->right, from);
}

void LazyIndex::overlapping(int64_t from, int64_t to, std::vector<Piece*>& out) const {
  out.clear();
  collect(root_, from, to, out);
}

}  // namespace kvsnap::detail

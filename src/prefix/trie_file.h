// Internal: a PrefixCache trie on disk — nodes, edges, flags, last-use order and every node's
// snapshots in one safetensors file, with the layers' configuration to check on load.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "persist/files.h"
#include "prefix/trie.h"

namespace kvsnap::detail {

// Bytes of the file for `trie`; `model_id` is recorded and must match on load.
std::string encode_trie(const Trie& trie, const std::string& model_id);

struct LoadedNode {
  int64_t parent = -1;  // index of an earlier node, -1 for the root
  std::vector<int32_t> edge;
  bool user = false;
  int64_t last_used = 0;
  std::vector<SnapshotPtr> snapshots;  // one per layer
};
struct LoadedTrie {
  std::vector<LoadedNode> nodes;  // parents before children
  int64_t clock = 0;
  // read_trie_file: per node, whether the budget evicts it (its snapshots were never read and
  // are null); build_trie removes those. Empty: every node stays.
  std::vector<bool> doomed;
  int64_t evicted = 0;  // the leaves that eviction removes (evicted_nodes counts them)
};

// Parses and validates everything (format, version, checksum, model id, the layers'
// configuration against `layers`, node structure, snapshot shapes and ranges); throws Error
// naming `source` on the first problem.
// `serving[i]`, when not empty, is the signature (snapshot_signature) of the snapshots the
// trie being replaced holds for layer i: the file's must be the same (the caches serve that
// layout).
LoadedTrie decode_trie(const std::string& bytes, const std::string& source,
                       const std::vector<LayerInfo>& layers, const std::string& model_id,
                       const std::vector<std::string>& serving = {});
// The same for a file read in parts (read_sealed_file: the load holds its tensors, not the file's
// bytes as well).
LoadedTrie decode_trie(const SealedFile& sealed, const std::string& source,
                       const std::vector<LayerInfo>& layers, const std::string& model_id,
                       const std::vector<std::string>& serving = {});
// Reads a sealed file keeping what `keep` keeps (read_sealed_file, or read_sealed of bytes).
using SealedRead = std::function<SealedFile(const TensorFilter& keep)>;
// The file `read` reads (named `source` in errors), decoded as decode_trie decodes it — every
// check on every node — but reading the data of only the nodes that a trie of `budget` bytes
// keeps after a load's eviction (plan_load): the others are hashed as they pass, never held,
// and marked `doomed`. A load under a smaller budget than the saving cache's then holds at most
// what it keeps. Errors as decode_trie's, a damaged file's first.
LoadedTrie read_trie(const SealedRead& read, const std::string& source,
                     const std::vector<LayerInfo>& layers, const std::string& model_id,
                     const std::vector<std::string>& serving, int64_t budget);
// Per layer, the signature of the snapshots `trie` holds for it (empty where it holds none).
std::vector<std::string> held_signatures(const Trie& trie);

// A trie for `layers` holding `loaded`, built aside (less its doomed nodes, removed as the
// eviction removes leaves): Trie::take_nodes installs it.
std::unique_ptr<Trie> build_trie(const std::vector<LayerInfo>& layers, LoadedTrie loaded);

}  // namespace kvsnap::detail

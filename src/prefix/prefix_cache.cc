#include "kvsnap/prefix_cache.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "prefix/trie.h"
#include "prefix/trie_file.h"

namespace kvsnap {
namespace detail {
namespace {

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

std::vector<LayerInfo> describe_layers(const std::vector<Cache*>& layers) {
  std::vector<LayerInfo> out;
  for (Cache* cache : layers) {
    LayerInfo info;
    info.cache = cache;
    if (cache != nullptr) info.rule = cache->restore_rule();
    out.push_back(info);
  }
  return out;
}

}  // namespace

// One request's state, shared by its Session handle and the PrefixCache while it is open. The
// PrefixCache detaches it (owner = null) when destroyed first, so the handle never dangles.
struct SessionState {
  enum class Phase {
    prefill,  // begun: the model evaluates remaining(), then prefill_done()
    decode,   // prefill attached: generated tokens are appended
    closed,
  };
  PrefixCacheImpl* owner = nullptr;
  Phase phase = Phase::prefill;
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t prompt_length = 0;
  int64_t matched = 0;    // prompt tokens found in the trie
  int64_t cached = 0;     // offset restored
  int64_t paged_end = 0;  // the trie holds the session's path up to here
  std::set<int64_t> user_offsets;
  std::vector<int64_t> scheduled;
};

namespace {

// How one whole-state layer gets to the planned offset.
struct WholeStateStep {
  enum class Kind { stay, reset, live_rewind, snapshot } kind = Kind::stay;
  Node* node = nullptr;  // for `snapshot`
};

}  // namespace

class PrefixCacheImpl {
 public:
  PrefixCacheImpl(std::vector<Cache*> layers, PrefixCache::Options options)
      : trie(describe_layers(layers)), options(options) {
    if (options.max_paged_out_bytes < 0) {
      throw Error(fmt::format("PrefixCache: max_paged_out_bytes {} must be >= 0",
                              options.max_paged_out_bytes));
    }
  }
  // An open session outlives us detached: its calls throw, its destructor does nothing.
  ~PrefixCacheImpl() {
    if (session != nullptr) session->owner = nullptr;
  }

  bool open() const { return session != nullptr; }

  // ---- live state -------------------------------------------------------------------------

  bool has_state() const {
    for (const LayerInfo& layer : trie.layers()) {
      if (layer.cache != nullptr) return true;
    }
    return false;
  }

  // The offset every stateful layer stands at, or -1 when they disagree.
  int64_t layer_offset() const {
    int64_t offset = -2;
    for (const LayerInfo& layer : trie.layers()) {
      if (layer.cache == nullptr) continue;
      if (offset == -2) {
        offset = layer.cache->offset();
      } else if (layer.cache->offset() != offset) {
        return -1;
      }
    }
    return offset == -2 ? static_cast<int64_t>(live_tokens.size()) : offset;
  }

  // Forgets the live state (e.g. when the caches were moved behind our back).
  void reset_live() {
    for (const LayerInfo& layer : trie.layers()) {
      if (layer.cache == nullptr) continue;
      layer.cache->cancel_snapshots();
      layer.cache->reset();
    }
    live_tokens.clear();
    tip = &trie.root();
  }

  // The deepest node on the live path holding a live token: it and its ancestors are pinned.
  void update_tip() {
    tip = &trie.root();
    const Trie::Match match = trie.match(live_tokens);
    for (Node* node : match.path) {
      if (node->start() < static_cast<int64_t>(live_tokens.size())) tip = node;
    }
  }

  bool on_active_path(const Node& node) const {
    for (const Node* n = tip; n != nullptr; n = n->parent) {
      if (n == &node) return true;
    }
    return false;
  }

  void evict_to_budget() {
    const auto keep = [this](const Node& n) { return on_active_path(n); };
    std::vector<Node*> leaves;
    while (trie.bytes() > options.max_paged_out_bytes) {
      leaves.clear();
      trie.leaves(leaves);
      Node* victim = nullptr;
      for (Node* leaf : leaves) {
        if (on_active_path(*leaf)) continue;
        // Non-user leaves go first, each group least recently used first.
        if (victim == nullptr ||
            std::pair(leaf->user, leaf->last_used) < std::pair(victim->user, victim->last_used)) {
          victim = leaf;
        }
      }
      if (victim == nullptr) break;  // only the active path is left
      trie.remove_leaf(*victim, keep);
      ++stats.evicted_nodes;
    }
    if (trie.bytes() > options.max_paged_out_bytes) drop_active_path_states();
  }

  // Last resort under the budget: the active path cannot be evicted (the live caches stand on
  // it), but the owned snapshots its nodes keep are restore points for later divergence, not
  // needed for the live state. Drop them, least recently used (non-user) nodes first.
  void drop_active_path_states() {
    std::vector<Node*> path;
    for (Node* n = tip; n != nullptr && n != &trie.root(); n = n->parent) path.push_back(n);
    std::sort(path.begin(), path.end(), [](const Node* a, const Node* b) {
      return std::pair(a->user, a->last_used) < std::pair(b->user, b->last_used);
    });
    for (Node* node : path) {
      for (size_t i = 0; i < trie.layers().size(); ++i) {
        if (trie.bytes() <= options.max_paged_out_bytes) return;
        const SnapshotPtr& s = node->snapshots[i];
        if (trie.layers()[i].whole_state() && s != nullptr && s->size() > 0) {
          trie.replace(*node, i, nullptr);
          ++stats.dropped_snapshots;
        }
      }
    }
  }

  // ---- planning -----------------------------------------------------------------------------

  // The deepest offset <= limit every layer can be restored to along `path`, given that the live
  // state shares its first `shared` tokens with the prompt.
  int64_t plan(const std::vector<Node*>& path, int64_t limit, int64_t shared) const {
    const auto live = static_cast<int64_t>(live_tokens.size());
    std::vector<int64_t> candidates{limit, 0};
    for (Node* node : path) candidates.push_back(std::min(node->end, limit));
    candidates.push_back(std::min({live, shared, limit}));
    std::sort(candidates.rbegin(), candidates.rend());
    for (int64_t t : candidates) {
      if (t > limit) continue;
      bool everyone = true;
      for (size_t i = 0; i < trie.layers().size() && everyone; ++i) {
        everyone = reachable(i, path, t, shared);
      }
      if (everyone) return t;
    }
    return 0;
  }

  bool reachable(size_t i, const std::vector<Node*>& path, int64_t t, int64_t shared) const {
    return !trie.layers()[i].whole_state() || whole_state_step(i, path, t, shared).has_value();
  }

  std::optional<WholeStateStep> whole_state_step(size_t i, const std::vector<Node*>& path,
                                                 int64_t t, int64_t shared) const {
    using Kind = WholeStateStep::Kind;
    const int64_t limit = trie.layers()[i].rule.rewind_limit;
    const auto live = static_cast<int64_t>(live_tokens.size());
    if (t == live && shared >= live) return WholeStateStep{Kind::stay};
    if (limit > 0 && live <= limit && t <= std::min(live, shared)) {
      return WholeStateStep{Kind::live_rewind};
    }
    if (t == 0) return WholeStateStep{Kind::reset};
    for (Node* node : path) {
      if (node->snapshots[i] == nullptr) continue;
      if (node->end == t || (node->end > t && node->end <= limit)) {
        return WholeStateStep{Kind::snapshot, node};
      }
    }
    return std::nullopt;
  }

  // ---- switching the live caches -------------------------------------------------------------

  // Moves every layer to offset `target` on `path`; `shared` tokens of the live state are on it.
  void switch_to(const std::vector<Node*>& path, int64_t target, int64_t shared) {
    for (size_t i = 0; i < trie.layers().size(); ++i) {
      Cache* cache = trie.layers()[i].cache;
      if (cache == nullptr) continue;
      bool ok = true;
      if (trie.layers()[i].ranged()) {
        ok = page_in_ranges(i, path, target, shared);
      } else {
        const WholeStateStep step = *whole_state_step(i, path, target, shared);
        switch (step.kind) {
          case WholeStateStep::Kind::stay:
            break;
          case WholeStateStep::Kind::reset:
            cache->reset();
            break;
          case WholeStateStep::Kind::live_rewind:
            ok = cache->restore(nullptr, target);
            break;
          case WholeStateStep::Kind::snapshot:
            ok = cache->restore(step.node->snapshots[i].get(), target);
            if (ok && step.node->end == target) relazify(*step.node, i, 0);
            break;
        }
      }
      if (!ok) {
        throw Error(
            fmt::format("PrefixCache::begin: internal error: layer {} could not reach "
                        "offset {}",
                        i, target));
      }
    }
  }

  // KV layer: rewind to what the live state shares, then write the path's ranges up to target.
  bool page_in_ranges(size_t i, const std::vector<Node*>& path, int64_t target, int64_t shared) {
    Cache& cache = *trie.layers()[i].cache;
    if (target <= shared) return cache.restore(nullptr, target);
    if (!cache.restore(nullptr, shared)) return false;
    for (Node* node : path) {
      if (node->end <= shared || node->start() >= target) continue;
      Snapshot* s = node->snapshots[i].get();
      if (s == nullptr) return false;
      const int64_t to = std::min(node->end, target);
      if (!cache.restore(s, to)) return false;
      if (to == node->end) relazify(*node, i, node->start());
    }
    return true;
  }

  // After a restore put a node's owned data into the live cache, the node can hold a lazy
  // view of it instead and give its bytes back.
  void relazify(Node& node, size_t i, int64_t from) {
    if (node.snapshots[i] == nullptr || node.snapshots[i]->size() == 0) return;
    SnapshotPtr lazy = trie.layers()[i].cache->snapshot(from);
    if (lazy != nullptr && lazy->is_lazy()) trie.replace(node, i, std::move(lazy));
  }

  // ---- session -------------------------------------------------------------------------------

  // Whether a node ends at `offset` on the matched path with every whole-state snapshot.
  bool complete_boundary(const std::vector<Node*>& path, int64_t offset) const {
    for (Node* node : path) {
      if (node->end != offset) continue;
      for (size_t i = 0; i < trie.layers().size(); ++i) {
        if (trie.layers()[i].whole_state() && node->snapshots[i] == nullptr) return false;
      }
      return true;
    }
    return false;
  }

  void prepare(const std::vector<int64_t>& offsets) {
    for (const LayerInfo& layer : trie.layers()) {
      if (layer.cache == nullptr) continue;
      layer.cache->cancel_snapshots();
      layer.cache->prepare_snapshots(offsets);
    }
    session->scheduled = offsets;
  }

  std::vector<int64_t> schedule_for(const std::vector<Node*>& path) const {
    const SessionState& s = *session;
    const int64_t length = s.prompt_length;
    std::set<int64_t> offsets(s.user_offsets.begin(), s.user_offsets.end());
    // The branch point, so the next divergence there restores, and the last prompt token, so
    // a regeneration of this prompt restores everything but that token.
    for (int64_t o : {s.matched < length - 1 ? s.matched : length - 1, length - 1}) {
      if (o > s.cached || (o == s.cached && o > 0 && !complete_boundary(path, o))) {
        offsets.insert(o);
      }
    }
    return {offsets.begin(), offsets.end()};
  }

  std::shared_ptr<SessionState> begin(std::span<const int32_t> prompt) {
    if (open()) throw Error("PrefixCache::begin: a session is already open; close it first");
    if (prompt.empty()) {
      throw Error("PrefixCache::begin: the prompt is empty; at least one token must be evaluated");
    }
    if (layer_offset() != static_cast<int64_t>(live_tokens.size())) reset_live();
    evict_to_budget();

    const Trie::Match match = trie.match(prompt);
    const auto length = static_cast<int64_t>(prompt.size());
    const int64_t limit = std::min(match.length, length - 1);  // leave one token to evaluate
    const int64_t shared =
        common_prefix(live_tokens, prompt.subspan(0, static_cast<size_t>(limit)));
    const int64_t target = plan(match.path, limit, shared);
    try {
      switch_to(match.path, target, shared);
    } catch (...) {
      reset_live();
      throw;
    }
    live_tokens.assign(prompt.begin(), prompt.begin() + target);
    update_tip();
    for (Node* node : match.path) node->last_used = trie.tick();

    auto state = std::make_shared<SessionState>();
    state->owner = this;
    state->tokens.assign(prompt.begin(), prompt.end());
    state->prompt_length = length;
    state->matched = match.length;
    state->cached = target;
    session = state;
    prepare(schedule_for(match.path));

    ++stats.lookups;
    stats.matched_tokens += match.length;
    stats.reused_tokens += target;
    evict_to_budget();
    return state;
  }

  void schedule_snapshots(std::span<const int64_t> offsets) {
    SessionState& s = *session;
    if (s.phase != SessionState::Phase::prefill || layer_offset() != s.cached) {
      throw Error(
          fmt::format("Session::schedule_snapshots: call before the prefill forward (the "
                      "caches are at offset {}, the session restored {})",
                      layer_offset(), s.cached));
    }
    for (int64_t o : offsets) {
      if (o < s.cached || o > s.prompt_length) {
        throw Error(
            fmt::format("Session::schedule_snapshots: offset {} in [{}] is outside [{}, "
                        "{}] (the restored prefix to the prompt's end)",
                        o, fmt::join(offsets, ", "), s.cached, s.prompt_length));
      }
    }
    s.user_offsets.insert(offsets.begin(), offsets.end());
    // The match may be stale if evictions ran since begin; recompute it from the trie.
    const std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_length));
    prepare(schedule_for(trie.match(prompt).path));
  }

  void prefill_done() {
    SessionState& s = *session;
    if (s.phase != SessionState::Phase::prefill) {
      throw Error("Session::prefill_done: already called for this session");
    }
    const int64_t offset = layer_offset();
    if (has_state() && offset != s.prompt_length) {
      throw Error(
          fmt::format("Session::prefill_done: the caches are at offset {}; evaluate "
                      "remaining() ({} tokens from offset {}) first",
                      offset, s.prompt_length - s.cached, s.cached));
    }
    attach_captures(/*complete=*/true);
    live_tokens.assign(s.tokens.begin(), s.tokens.begin() + s.prompt_length);
    update_tip();
    s.phase = SessionState::Phase::decode;
    evict_to_budget();
  }

  // Takes the layers' captures of the session's schedule — all of them, or (a prefill cut
  // short) those the evaluated tokens reached — and inserts them as trie nodes.
  void attach_captures(bool complete) {
    SessionState& s = *session;
    const size_t layers = trie.layers().size();
    std::vector<std::vector<SnapshotPtr>> captures(layers);
    size_t reached = s.scheduled.size();
    for (size_t i = 0; i < layers; ++i) {
      Cache* cache = trie.layers()[i].cache;
      if (cache == nullptr) continue;
      captures[i] = complete ? cache->take_snapshots() : cache->take_reached_snapshots();
      reached = std::min(reached, captures[i].size());
    }
    int64_t edge_start = s.cached;
    for (size_t j = 0; j < reached; ++j) {
      std::vector<SnapshotPtr> ranged(layers), whole(layers);
      for (size_t i = 0; i < layers; ++i) {
        if (trie.layers()[i].ranged()) ranged[i] = std::move(captures[i][j]);
        if (trie.layers()[i].whole_state()) whole[i] = std::move(captures[i][j]);
      }
      if (s.scheduled[j] > 0) {
        trie.insert(s.tokens, edge_start, s.scheduled[j], std::move(ranged), std::move(whole),
                    s.user_offsets.count(s.scheduled[j]) > 0);
      }
      edge_start = s.scheduled[j];
    }
    s.paged_end = edge_start;
    s.scheduled.clear();
  }

  void append_output(int32_t token) {
    SessionState& s = *session;
    if (s.phase != SessionState::Phase::decode) {
      throw Error("Session::append_output: call prefill_done() after the prefill forward first");
    }
    s.tokens.push_back(token);
  }

  void close() {
    SessionState& s = *session;
    int64_t offset = layer_offset();
    if (s.phase == SessionState::Phase::prefill) {
      if (offset == s.prompt_length || !has_state()) {
        prefill_done();
      } else if (offset >= s.cached && offset < s.prompt_length) {
        // A prefill cut short: keep the captures it passed, as restore points.
        attach_captures(/*complete=*/false);
      } else {
        for (const LayerInfo& layer : trie.layers()) {
          if (layer.cache != nullptr) layer.cache->cancel_snapshots();
        }
        s.scheduled.clear();
        s.paged_end = s.cached;
      }
    }
    offset = has_state() ? layer_offset() : static_cast<int64_t>(s.tokens.size());
    s.phase = SessionState::Phase::closed;
    const std::shared_ptr<SessionState> closing = std::move(session);
    if (offset < 0 || offset > static_cast<int64_t>(s.tokens.size()) || offset < s.paged_end) {
      // The caches were driven past what the session knows: nothing consistent to page out.
      reset_live();
      evict_to_budget();
      return;
    }
    if (offset > s.paged_end) {
      std::vector<SnapshotPtr> ranged(trie.layers().size()), whole(trie.layers().size());
      for (size_t i = 0; i < trie.layers().size(); ++i) {
        const LayerInfo& layer = trie.layers()[i];
        if (layer.ranged()) ranged[i] = layer.cache->snapshot(s.paged_end);
        if (layer.whole_state()) whole[i] = layer.cache->snapshot(0);
      }
      trie.insert(s.tokens, s.paged_end, offset, std::move(ranged), std::move(whole), false);
    }
    live_tokens.assign(s.tokens.begin(), s.tokens.begin() + offset);
    update_tip();
    evict_to_budget();
  }

  Trie trie;
  PrefixCache::Options options;
  PrefixCache::Stats stats;
  std::vector<int32_t> live_tokens;  // what the live caches hold, [0, their offset)
  Node* tip = &trie.root();

  std::shared_ptr<SessionState> session;  // the open session, if any
};

}  // namespace detail

PrefixCache::PrefixCache(std::vector<Cache*> layers) : PrefixCache(std::move(layers), Options{}) {}
PrefixCache::PrefixCache(std::vector<Cache*> layers, Options options)
    : impl_(std::make_unique<detail::PrefixCacheImpl>(std::move(layers), options)) {}
PrefixCache::~PrefixCache() = default;

namespace {
std::string trie_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "prefix_cache.safetensors").string();
}
}  // namespace

void PrefixCache::save(const std::string& dir, const std::string& model_id) const {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error)
    throw Error(fmt::format("PrefixCache::save: cannot create {} ({})", dir, error.message()));
  detail::write_file_atomically(trie_path(dir), detail::encode_trie(impl_->trie, model_id));
}

void PrefixCache::load(const std::string& dir, const std::string& model_id) {
  if (impl_->open()) throw Error("PrefixCache::load: a session is open; close it first");
  const std::string path = trie_path(dir);
  detail::remove_stale_temporaries(path);
  detail::LoadedTrie loaded =
      detail::decode_trie(detail::read_file(path), path, impl_->trie.layers(), model_id);
  impl_->reset_live();
  detail::install(impl_->trie, std::move(loaded));
  impl_->tip = &impl_->trie.root();
  impl_->evict_to_budget();
}

bool PrefixCache::saved_in(const std::string& dir) {
  return std::filesystem::exists(trie_path(dir));
}

PrefixCache::Session PrefixCache::begin(std::span<const int32_t> prompt) {
  return Session(impl_->begin(prompt));
}
int64_t PrefixCache::paged_out_bytes() const { return impl_->trie.bytes(); }
int64_t PrefixCache::recount_paged_out_bytes() const { return impl_->trie.recount_bytes(); }
int64_t PrefixCache::node_count() const { return impl_->trie.node_count(); }
PrefixCache::Stats PrefixCache::stats() const { return impl_->stats; }
std::string PrefixCache::debug_string() const { return impl_->trie.debug_string(); }
std::string PrefixCache::check_invariants() const { return impl_->trie.check_invariants(); }

PrefixCache::Session::Session(std::shared_ptr<detail::SessionState> state)
    : state_(std::move(state)) {}
PrefixCache::Session::Session(Session&& other) noexcept = default;
PrefixCache::Session& PrefixCache::Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    try {
      close();
    } catch (...) {  // close() leaves the cache consistent; a move must not throw
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
PrefixCache::Session::~Session() {
  try {
    close();
  } catch (...) {  // a destructor must not throw; close() already left the cache consistent
  }
}

namespace {
// The PrefixCache of an open, attached session; throws Error naming `call` otherwise.
detail::PrefixCacheImpl& owner_of(const std::shared_ptr<detail::SessionState>& state,
                                  const char* call) {
  if (state != nullptr && state->owner == nullptr) {
    throw Error(fmt::format("{}: the PrefixCache this session belongs to was destroyed", call));
  }
  if (state == nullptr || state->phase == detail::SessionState::Phase::closed) {
    throw Error(fmt::format("{}: the session is closed", call));
  }
  return *state->owner;
}
}  // namespace

std::span<const int32_t> PrefixCache::Session::remaining() const {
  (void)owner_of(state_, "Session::remaining");
  return std::span<const int32_t>(state_->tokens.data() + state_->cached,
                                  static_cast<size_t>(state_->prompt_length - state_->cached));
}
int64_t PrefixCache::Session::cached() const {
  (void)owner_of(state_, "Session::cached");
  return state_->cached;
}
void PrefixCache::Session::schedule_snapshots(std::span<const int64_t> offsets) {
  owner_of(state_, "Session::schedule_snapshots").schedule_snapshots(offsets);
}
void PrefixCache::Session::prefill_done() {
  owner_of(state_, "Session::prefill_done").prefill_done();
}
void PrefixCache::Session::append_output(int32_t token) {
  owner_of(state_, "Session::append_output").append_output(token);
}
void PrefixCache::Session::close() {
  if (state_ == nullptr || state_->owner == nullptr ||
      state_->phase == detail::SessionState::Phase::closed) {
    return;
  }
  state_->owner->close();
}

}  // namespace kvsnap

#include "kvsnap/prefix_cache.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "prefix/live_state.h"
#include "prefix/planner.h"
#include "prefix/trie.h"
#include "prefix/trie_file.h"

namespace kvsnap {
namespace detail {
namespace {

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
  std::vector<int64_t> scheduled;  // the captures the layers were asked for, ascending
};

// The trie, the live caches' state and the open session: begin plans (planner.h) and switches
// (live_state.h); the session schedules captures and pages its path out into the trie.
class PrefixCacheImpl {
 public:
  PrefixCacheImpl(std::vector<Cache*> layers, PrefixCache::Options options)
      : trie(describe_layers(layers)), live(trie), options(options) {
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
  void evict() {
    evict_to_budget(trie, live, options.max_paged_out_bytes, stats.evicted_nodes,
                    stats.dropped_snapshots);
  }
  // The offset every layer stands at, as the session needs it (-1 never matches an offset).
  int64_t layer_offset() const { return live.offset().value_or(-1); }

  std::shared_ptr<SessionState> begin(std::span<const int32_t> prompt) {
    if (open()) throw Error("PrefixCache::begin: a session is already open; close it first");
    if (prompt.empty()) {
      throw Error("PrefixCache::begin: the prompt is empty; at least one token must be evaluated");
    }
    if (!live.consistent()) live.reset();  // the caches were moved behind our back
    evict();

    const Trie::Match match = trie.match(prompt);
    const auto length = static_cast<int64_t>(prompt.size());
    const int64_t limit = std::min(match.length, length - 1);  // leave one token to evaluate
    const LiveView view{
        static_cast<int64_t>(live.tokens().size()),
        common_prefix(live.tokens(), prompt.subspan(0, static_cast<size_t>(limit)))};
    const Plan plan = plan_restore(trie.layers(), match.path, limit, view);
    try {
      live.switch_to(match.path, plan, view.shared);
    } catch (...) {
      live.reset();
      throw;
    }
    live.set_tokens(prompt.subspan(0, static_cast<size_t>(plan.target)));
    for (Node* node : match.path) trie.touch(*node);

    auto state = std::make_shared<SessionState>();
    state->owner = this;
    state->tokens.assign(prompt.begin(), prompt.end());
    state->prompt_length = length;
    state->matched = match.length;
    state->cached = plan.target;
    session = state;
    prepare(schedule_for(match.path));

    ++stats.lookups;
    stats.matched_tokens += match.length;
    stats.reused_tokens += plan.target;
    evict();
    return state;
  }

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
    if (live.has_state() && offset != s.prompt_length) {
      throw Error(
          fmt::format("Session::prefill_done: the caches are at offset {}; evaluate "
                      "remaining() ({} tokens from offset {}) first",
                      offset, s.prompt_length - s.cached, s.cached));
    }
    attach_captures(/*complete=*/true);
    live.set_tokens(std::span(s.tokens).subspan(0, static_cast<size_t>(s.prompt_length)));
    s.phase = SessionState::Phase::decode;
    evict();
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
    if (s.phase == SessionState::Phase::prefill) {
      const int64_t offset = layer_offset();
      if (offset == s.prompt_length || !live.has_state()) {
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
    const int64_t offset =
        live.has_state() ? layer_offset() : static_cast<int64_t>(s.tokens.size());
    s.phase = SessionState::Phase::closed;
    const std::shared_ptr<SessionState> closing = std::move(session);
    if (offset < 0 || offset > static_cast<int64_t>(s.tokens.size()) || offset < s.paged_end) {
      // The caches were driven past what the session knows: nothing consistent to page out.
      live.reset();
      evict();
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
    live.set_tokens(std::span(s.tokens).subspan(0, static_cast<size_t>(offset)));
    evict();
  }

  Trie trie;
  LiveState live;
  PrefixCache::Options options;
  PrefixCache::Stats stats;
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
  impl_->live.reset();
  detail::install(impl_->trie, std::move(loaded));
  impl_->evict();
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

#include "prefix/slot.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <new>
#include <utility>

#include "prefix/tier_link.h"

namespace kvsnap::detail {

namespace {

// The deepest node a restore along `path` by `plan` needs pinned: the path up to the target and
// every node a whole-state step restores from.
Node* pinned_tip(const std::vector<Node*>& path, const Plan& plan, Node* root) {
  Node* tip = root;
  for (Node* node : path) {
    const bool step = std::any_of(plan.steps.begin(), plan.steps.end(),
                                  [&](const WholeStateStep& s) { return s.node == node; });
    if (node->start() < plan.target || step) tip = node;
  }
  return tip;
}

}  // namespace

int64_t Slot::match(std::span<const int32_t> prompt) const {
  if (prompt.empty()) return 0;
  const Trie::Match found = trie_.match(prompt);
  const int64_t limit = trie_.restore_limit(found, static_cast<int64_t>(prompt.size()));
  LiveView live = view(prompt, limit);
  if (!live_.consistent()) live = LiveView{};
  return plan_restore(trie_.layers(), found.path, limit, live).target;
}

std::shared_ptr<SessionState> Slot::begin(std::span<const int32_t> prompt, PrefixCacheImpl* owner,
                                          PrefixCache::Stats& stats) {
  if (open()) {
    throw Error(
        fmt::format("PrefixCache::begin: slot {} has a session already open; close it first", id_));
  }
  if (prompt.empty()) {
    throw Error("PrefixCache::begin: the prompt is empty; at least one token must be evaluated");
  }
  require_no_schedule();
  if (!live_.consistent()) reset_moved_caches();
  evict_(Change::own);

  const auto length = static_cast<int64_t>(prompt.size());
  Trie::Match match;
  LiveView live;
  Plan plan;
  const auto make_plan = [&] {
    match = trie_.match(prompt);
    const int64_t limit = trie_.restore_limit(match, length);
    live = view(prompt, limit);
    plan = plan_restore(trie_.layers(), match.path, limit, live);
  };
  make_plan();
  try {
    // The switch rewinds the caches to what they share with the prompt and writes the path's
    // ranges and states over what they held: the trie's lazy snapshots of the old path there
    // are copied out (KV) or left the only holders of their blocks (paged). Reserve that first,
    // with the new path pinned, so the eviction makes room (the old path's nodes past the
    // shared part may go) before anything is copied — again with a new plan when the eviction
    // changed the trie (its rewind may lie lower), until a round changes nothing: the plan
    // used is always the trie's latest, and its rewind reserved. (A round that goes on evicted
    // a node, or split a partly live tip, which a later round can do again only after a merge,
    // which follows an eviction: the trie shrinks, so the rounds end; in practice one to three:
    // tests/prefix/slot_replan_test.cc.)
    for (;;) {
      const uint64_t version = trie_.version();
      live_.begin_switch(pinned_tip(match.path, plan, &trie_.root()),
                         std::min(live.shared, plan.target));  // where the KV layers rewind
      evict_(Change::own);
      if (trie_.version() == version) break;
      make_plan();
    }
    live_.switch_to(match.path, plan, live.shared);
    // Inside: a record that runs out would leave the old path's tokens over the moved caches.
    live_.set_tokens(prompt.subspan(0, static_cast<size_t>(plan.target)));
    live_.end_switch();
  } catch (...) {
    abandon();  // the caches reset, and the trie back within its budget (their copies out)
    throw;
  }
  for (Node* node : match.path) trie_.touch(*node);

  std::shared_ptr<SessionState> state;
  try {
    state = std::make_shared<SessionState>();
    state->owner = owner;
    state->slot = id_;
    state->prompt.assign(prompt.begin(), prompt.end());
    state->tokens = state->prompt;
    state->prompt_length = length;
    state->matched = match.length;
    state->cached = plan.target;
    session_ = state;
    prepare(schedule_for(match.path));
    // The switch may have shared what other slots' caches hold: every exposure is refreshed.
    evict_(Change::shared);
  } catch (...) {
    // The session never reaches its caller: the slot must not stay open (or writable) with no
    // handle to close it (out of memory making the session, scheduling or evicting).
    abandon();
    throw;
  }
  ++stats.lookups;
  stats.matched_tokens += match.length;
  stats.reused_tokens += plan.target;
  return state;
}

void Slot::require_no_schedule(const char* call) const {
  // With no session open, the slot's schedules are someone else's: the restores and captures a
  // begin makes would take or cancel them.
  for (size_t i = 0; i < trie_.layers().size(); ++i) {
    const Cache* cache = trie_.layers()[i].cache;
    if (cache == nullptr) continue;
    const ScheduleState state = cache->schedule_state(id_);
    if (!state.pending) continue;
    throw Error(fmt::format(
        "{}: layer {} has {} capture(s) scheduled for slot {} (offsets {}..{}) that no session "
        "made (a Speculation round still open?); accept or cancel it first",
        call, i, state.count, id_, state.first, state.last));
  }
}

void Slot::reset_moved_caches() {
  // The reset hands the trie's snapshots what they name in the caches (a KV range is copied
  // out): reserved as a rewind to 0 would be, and evicted for, before it runs. Nothing of the
  // old path is pinned: the caches no longer stand on it.
  live_.begin_switch(&trie_.root(), 0);
  try {
    evict_(Change::own);
    live_.reset();
  } catch (...) {
    live_.end_switch();
    live_.set_writable(false);
    throw;
  }
  live_.end_switch();
  live_.set_writable(false);
}

void Slot::abandon() noexcept {
  if (session_ != nullptr) {
    session_->phase = SessionState::Phase::closed;
    session_->owner = nullptr;
    session_.reset();
  }
  live_.set_writable(false);
  try {
    reset_moved_caches();  // what the caches hold is not known to match any record
  } catch (...) {          // the caller's failure is the one reported
    try {  // the eviction before the reset failed (memory): reset anyway, then make room
      live_.reset();
      evict_(Change::own);
    } catch (...) {
    }
  }
}

void Slot::detach() noexcept {
  if (session_ == nullptr) return;
  SessionState& s = *session_;
  s.owner = nullptr;
  if (s.phase != SessionState::Phase::prefill || s.scheduled.empty()) return;
  // Only a schedule that is the session's own: after prefill_done the layers' schedules are
  // their callers' (a Speculation round's), not the session's.
  const std::vector<LayerInfo>& layers = trie_.layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerInfo& layer = layers[i];
    if (layer.cache == nullptr) continue;
    try {
      // Known by its number where the kind numbers its schedules (someone else's of the same
      // offsets is not the session's), else by its offsets.
      const ScheduleState state = layer.cache->schedule_state(id_);
      const uint64_t serial = i < s.serials.size() ? s.serials[i] : 0;
      const bool own = state.known && state.pending &&
                       (serial != 0 ? state.serial == serial
                                    : state.count == static_cast<int64_t>(s.scheduled.size()) &&
                                          state.first == s.scheduled.front() &&
                                          state.last == s.scheduled.back());
      if (own) layer.cache->cancel_snapshots(id_);
    } catch (...) {  // a layer that refuses keeps its schedule; the others are still cancelled
    }
  }
}

// Whether a node ends at `offset` on the matched path with every whole-state snapshot.
bool Slot::complete_boundary(const std::vector<Node*>& path, int64_t offset) const {
  for (Node* node : path) {
    if (node->end != offset) continue;
    for (size_t i = 0; i < trie_.layers().size(); ++i) {
      if (trie_.layers()[i].whole_state() && node->snapshots[i] == nullptr) return false;
    }
    return true;
  }
  return false;
}

void Slot::prepare(std::vector<int64_t> offsets) {
  const std::vector<LayerInfo>& layers = trie_.layers();
  std::vector<uint64_t>& serials = session_->serials;
  serials.resize(layers.size());  // before anything changes
  const auto schedule = [&](const std::vector<int64_t>& chosen) {
    for (size_t i = 0; i < layers.size(); ++i) {
      serials[i] = 0;
      if (layers[i].cache == nullptr) continue;
      layers[i].cache->cancel_snapshots(id_);
      layers[i].cache->prepare_snapshots(id_, chosen);
      serials[i] = layers[i].cache->schedule_state(id_).serial;
    }
  };
  try {
    schedule(offsets);
  } catch (...) {
    // No write has come since the session's schedule was made (the caches stand where it
    // began), so making it again captures the same.
    std::vector<int64_t>& scheduled = session_->scheduled;
    try {
      schedule(scheduled);
    } catch (...) {
      for (const LayerInfo& layer : trie_.layers()) {
        try {
          if (layer.cache != nullptr) layer.cache->cancel_snapshots(id_);
        } catch (...) {  // nothing is left of what it was asked to capture either way
        }
      }
      scheduled.clear();
    }
    throw;
  }
  session_->scheduled = std::move(offsets);  // allocates nothing
}

std::vector<int64_t> Slot::schedule_for(const std::vector<Node*>& path) const {
  const SessionState& s = *session_;
  const int64_t length = s.prompt_length;
  std::set<int64_t> offsets(s.user_offsets.begin(), s.user_offsets.end());
  offsets.insert(s.branch_offsets.begin(), s.branch_offsets.end());
  // The branch point, so the next divergence there restores, and the last prompt token, so
  // a regeneration of this prompt restores everything but that token.
  for (int64_t o : {s.matched < length - 1 ? s.matched : length - 1, length - 1}) {
    if (o > s.cached || (o == s.cached && o > 0 && !complete_boundary(path, o))) {
      offsets.insert(o);
    }
  }
  return {offsets.begin(), offsets.end()};
}

std::string Slot::describe_offset() const {
  if (const std::optional<int64_t> common = live_.offset())
    return fmt::format("offset {}", *common);
  std::vector<std::string> each;
  for (size_t i = 0; i < trie_.layers().size(); ++i) {
    if (const Cache* cache = trie_.layers()[i].cache) {
      each.push_back(fmt::format("layer {} at {}", i, cache->offset(id_)));
    }
  }
  return fmt::format("different offsets ({})", fmt::join(each, ", "));
}

void Slot::schedule_snapshots(std::span<const int64_t> offsets, bool user) {
  SessionState& s = *session_;
  const char* call = user ? "Session::schedule_snapshots" : "Session::schedule_branch_points";
  if (s.phase != SessionState::Phase::prefill || layer_offset() != s.cached) {
    throw Error(fmt::format(
        "{}: call before the prefill forward (the caches are at {}, the session restored {})", call,
        describe_offset(), s.cached));
  }
  for (int64_t o : offsets) {
    if (o < s.cached || o > s.prompt_length) {
      throw Error(
          fmt::format("{}: offset {} in [{}] is outside [{}, {}] (the restored prefix to the "
                      "prompt's end)",
                      call, o, fmt::join(offsets, ", "), s.cached, s.prompt_length));
    }
  }
  // A call that runs out leaves the session as it was: its offsets and its schedule.
  std::set<int64_t>& kept = user ? s.user_offsets : s.branch_offsets;
  std::set<int64_t> before = kept;
  try {
    kept.insert(offsets.begin(), offsets.end());
    // The match may be stale if evictions ran since begin; recompute it from the trie_.
    const std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_length));
    prepare(schedule_for(trie_.match(prompt).path));
  } catch (...) {
    kept = std::move(before);
    throw;
  }
}

void Slot::prefill_done() {
  SessionState& s = *session_;
  if (s.phase != SessionState::Phase::prefill) {
    throw Error("Session::prefill_done: already called for this session");
  }
  const int64_t offset = layer_offset();
  if (live_.has_state() && offset != s.prompt_length) {
    throw Error(
        fmt::format("Session::prefill_done: the caches are at {}; evaluate remaining() ({} "
                    "tokens from offset {}) first",
                    describe_offset(), s.prompt_length - s.cached, s.cached));
  }
  attach_captures();
  live_.set_tokens(std::span(s.tokens).subspan(0, static_cast<size_t>(s.prompt_length)));
  s.phase = SessionState::Phase::decode;
  evict_(Change::shared);  // the inserted nodes may have split others, lazy in other slots' caches
}

// Takes the layers' captures of the session's schedule that the evaluated tokens reached — all of
// them after a whole prefill, but one a write lost running out of memory (and those after it) —
// and inserts them as trie nodes.
void Slot::attach_captures() {
  SessionState& s = *session_;
  const size_t layers = trie_.layers().size();
  std::vector<std::vector<SnapshotPtr>> captures(layers);
  size_t reached = s.scheduled.size();
  for (size_t i = 0; i < layers; ++i) {
    Cache* cache = trie_.layers()[i].cache;
    if (cache == nullptr) continue;
    captures[i] = cache->take_reached_snapshots(id_);
    reached = std::min(reached, captures[i].size());
  }
  // What the captures own enters the trie with them: make room for it first (the session's
  // path is pinned), rather than insert it all past the budget and evict after.
  int64_t incoming = 0;
  for (size_t i = 0; i < layers; ++i) {
    for (size_t j = 0; j < std::min(reached, captures[i].size()); ++j) {
      if (captures[i][j] != nullptr && s.scheduled[j] > 0) incoming += captures[i][j]->size();
    }
  }
  if (incoming > 0) {
    live_.set_incoming(incoming);
    try {
      evict_(Change::own);
    } catch (const std::bad_alloc&) {  // a merge ran short: the eviction after the insert goes on
    } catch (...) {
      live_.set_incoming(0);
      throw;
    }
    live_.set_incoming(0);
  }
  int64_t edge_start = s.cached;
  for (size_t j = 0; j < reached; ++j) {
    std::vector<SnapshotPtr> ranged(layers), whole(layers);
    for (size_t i = 0; i < layers; ++i) {
      if (trie_.layers()[i].ranged()) ranged[i] = std::move(captures[i][j]);
      if (trie_.layers()[i].whole_state()) whole[i] = std::move(captures[i][j]);
    }
    if (s.scheduled[j] > 0) {
      trie_.insert(s.tokens, edge_start, s.scheduled[j], std::move(ranged), std::move(whole),
                   s.user_offsets.count(s.scheduled[j]) > 0);
    }
    edge_start = s.scheduled[j];
  }
  s.paged_end = edge_start;
  s.scheduled.clear();
}

void Slot::append_output(int32_t token) {
  SessionState& s = *session_;
  if (s.phase != SessionState::Phase::decode) {
    throw Error("Session::append_output: call prefill_done() after the prefill forward first");
  }
  // The step copied out part of what was reserved; reserve the next. Before the token is
  // recorded: a call that runs out records nothing, and the caller may call again.
  evict_(Change::decode);
  s.tokens.push_back(token);
}

void Slot::retract_outputs(int64_t count) {
  SessionState& s = *session_;
  const auto generated = static_cast<int64_t>(s.tokens.size()) - s.prompt_length;
  if (s.phase != SessionState::Phase::decode || count < 0 || count > generated) {
    throw Error(fmt::format(
        "Session::retract_outputs: count {} must be in [0, {}] (the tokens generated so far), "
        "after prefill_done()",
        count, s.phase == SessionState::Phase::decode ? generated : 0));
  }
  // A rollback into the prompt is not one of drafts: re-evaluating from there would overwrite
  // columns the trie's nodes on our path still name (copied into the trie, unreserved).
  for (size_t i = 0; i < trie_.layers().size(); ++i) {
    const Cache* cache = trie_.layers()[i].cache;
    if (cache == nullptr || cache->offset(id_) >= s.prompt_length) continue;
    throw Error(fmt::format(
        "Session::retract_outputs: layer {} stands at offset {}, inside the {}-token prompt; "
        "roll back only generated tokens (close the session and begin again to go further)",
        i, cache->offset(id_), s.prompt_length));
  }
  s.tokens.resize(s.tokens.size() - static_cast<size_t>(count));
}

void Slot::close() {
  try {
    close_session();
  } catch (...) {
    // The session ends whatever failed (out of memory inserting or evicting): a slot left open
    // could never be closed or begun again.
    abandon();
    throw;
  }
}

void Slot::close_session() {
  SessionState& s = *session_;
  if (s.phase == SessionState::Phase::prefill) {
    const int64_t offset = layer_offset();
    if (offset == s.prompt_length || !live_.has_state()) {
      prefill_done();
    } else if (offset >= s.cached && offset < s.prompt_length) {
      // A prefill cut short: keep the captures it passed, as restore points.
      attach_captures();
    } else {
      for (const LayerInfo& layer : trie_.layers()) {
        if (layer.cache != nullptr) layer.cache->cancel_snapshots(id_);
      }
      s.scheduled.clear();
      s.paged_end = s.cached;
    }
  }
  const int64_t offset = live_.has_state() ? layer_offset() : static_cast<int64_t>(s.tokens.size());
  s.phase = SessionState::Phase::closed;
  const std::shared_ptr<SessionState> closing = std::move(session_);
  s.owner = nullptr;          // a closed handle may outlive the PrefixCache: it must not name it
  live_.set_writable(false);  // nothing writes the caches before the slot's next begin
  if (offset < 0 || offset > static_cast<int64_t>(s.tokens.size()) || offset < s.paged_end) {
    // The caches were driven past what the session knows: nothing consistent to page out. The
    // reset is reserved for first, as a begin's is.
    reset_moved_caches();
    return;
  }
  if (offset > s.paged_end) {
    std::vector<SnapshotPtr> ranged(trie_.layers().size()), whole(trie_.layers().size());
    for (size_t i = 0; i < trie_.layers().size(); ++i) {
      const LayerInfo& layer = trie_.layers()[i];
      if (layer.ranged()) ranged[i] = layer.cache->snapshot(id_, s.paged_end);
      if (layer.whole_state()) whole[i] = layer.cache->snapshot(id_, 0);
    }
    trie_.insert(s.tokens, s.paged_end, offset, std::move(ranged), std::move(whole), false);
  }
  const auto evaluated = std::span(s.tokens).subspan(0, static_cast<size_t>(offset));
  live_.set_tokens(evaluated);
  if (tier_ != nullptr) store_to_tier(*tier_, trie_, id_, evaluated);
  evict_(Change::shared);  // as in prefill_done
}

}  // namespace kvsnap::detail

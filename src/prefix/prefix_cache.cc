#include "kvsnap/prefix_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <new>

#include "kvsnap/tier.h"
#include "persist/files.h"
#include "persist/safetensors.h"
#include "prefix/slot.h"
#include "prefix/tier_link.h"
#include "prefix/trie.h"
#include "prefix/trie_file.h"

namespace kvsnap {
namespace detail {
namespace {

std::vector<LayerInfo> describe_layers(const std::vector<Cache*>& layers) {
  // A cache listed twice would be prepared, captured and restored twice per step: the second
  // schedule replaces the first, and its snapshots are lost.
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto again =
        std::find(layers.begin() + static_cast<std::ptrdiff_t>(i) + 1, layers.end(), layers[i]);
    if (layers[i] != nullptr && again != layers.end()) {
      throw Error(fmt::format(
          "PrefixCache: layers {} and {} are the same Cache object; list a cache that several "
          "model layers share once (null for the others)",
          i, again - layers.begin()));
    }
  }
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

// The shared trie, its slots and the lock every call holds.
class PrefixCacheImpl {
 public:
  PrefixCacheImpl(std::vector<Cache*> layers, PrefixCache::Options options)
      : trie(describe_layers(layers)), options(options) {
    if (options.max_paged_out_bytes < 0) {
      throw Error(fmt::format("PrefixCache: max_paged_out_bytes {} must be >= 0",
                              options.max_paged_out_bytes));
    }
    if (options.slots < 1 || options.slots > kMaxSlots) {
      throw Error(
          fmt::format("PrefixCache: slots {} must be in [1, {}]", options.slots, kMaxSlots));
    }
    if (options.tier != nullptr && options.tier->layers() != layers) {
      const std::vector<Cache*>& theirs = options.tier->layers();
      size_t differs = 0;  // the first layer that is not the same object (or the shorter count)
      while (differs < std::min(theirs.size(), layers.size()) &&
             theirs[differs] == layers[differs]) {
        ++differs;
      }
      throw Error(fmt::format(
          "PrefixCache: the tier at {} was opened for other layers than this cache's: {} (the "
          "tier's {} layers, this cache's {}; a tier serves the very Cache objects it was "
          "opened with)",
          options.tier->address(),
          differs < std::min(theirs.size(), layers.size())
              ? fmt::format("layer {} is another Cache object", differs)
              : fmt::format("layer {} is missing", differs),
          theirs.size(), layers.size()));
    }
    for (SeqId id = 0; id < options.slots; ++id) {
      slots.push_back(std::make_unique<Slot>(
          trie, id, [this, id](Change change) { evict(id, change); }, this->options.tier.get()));
      live.push_back(&slots.back()->live());
    }
  }
  // Open sessions outlive us detached: their calls throw, their destructors do nothing, and the
  // captures they scheduled on the layers are cancelled (Slot::detach). (A call on a session in
  // flight on another thread finishes first; one that starts as this runs is the caller's to
  // order, as with any object destroyed while in use.)
  ~PrefixCacheImpl() {
    const std::lock_guard<std::mutex> lock(mutex);
    for (const auto& slot : slots) slot->detach();
  }

  static constexpr SeqId kMaxSlots = 4096;

  Slot& slot(SeqId id, const char* call) const {
    if (id < 0 || id >= static_cast<SeqId>(slots.size())) {
      throw Error(fmt::format("{}: slot {} outside [0, {})", call, id, slots.size()));
    }
    return *slots[static_cast<size_t>(id)];
  }
  bool any_open() const { return first_open() >= 0; }
  // The lowest slot with a session open, or -1.
  SeqId first_open() const {
    for (const auto& s : slots) {
      if (s->open()) return s->id();
    }
    return -1;
  }
  // Keeps the trie within its budget after a call of slot `caller` that made `change`.
  void evict(SeqId caller, Change change) {
    for (const auto& slot : slots) {
      if (change == Change::shared || slot->id() == caller) slot->live().refresh_exposure();
    }
    evict_to_budget(trie, live, options.max_paged_out_bytes, stats.evicted_nodes,
                    stats.dropped_snapshots, change == Change::decode, futile);
  }
  // Before begin on slot `id`: when the trie cannot restore all of `prompt` but its last token,
  // asks the tier — without the lock, so other calls go on meanwhile — and inserts what it found.
  void ask_tier(SeqId id, std::span<const int32_t> prompt) {
    const auto limit = static_cast<int64_t>(prompt.size()) - 1;
    int64_t held = 0;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      const Slot& s = slot(id, "PrefixCache::begin");
      if (s.open() || limit < 1) return;  // begin refuses the first; the second needs nothing
      s.require_no_schedule();            // begin's refusal, before the tier changes anything
      held = std::min(s.match(prompt), trie.match(prompt).length);
    }
    if (held >= limit) return;
    // More than the budget would be evicted as it is inserted: never read.
    TierMatch found = options.tier->lookup(prompt, limit, held, options.max_paged_out_bytes);
    if (found.offset == 0) return;
    const std::lock_guard<std::mutex> lock(mutex);
    const Slot& s = slot(id, "PrefixCache::begin");
    if (s.open()) return;  // begun meanwhile: this begin is refused
    s.require_no_schedule();
    // Each segment is evicted for alone (what other slots may copy out is as it was), every
    // slot's exposure refreshed once at the end.
    if (insert_from_tier(trie, prompt, std::move(found), [&] { evict(id, Change::own); })) {
      evict(id, Change::shared);
    }
  }

  mutable std::mutex mutex;
  Trie trie;
  PrefixCache::Options options;
  PrefixCache::Stats stats;
  std::vector<std::unique_ptr<Slot>> slots;
  std::vector<LiveState*> live;    // every slot's, for eviction
  uint64_t futile = ~uint64_t{0};  // see evict_to_budget
};

}  // namespace detail

using Lock = std::lock_guard<std::mutex>;

PrefixCache::PrefixCache(std::vector<Cache*> layers) : PrefixCache(std::move(layers), Options{}) {}
PrefixCache::PrefixCache(std::vector<Cache*> layers, Options options)
    : impl_(std::make_unique<detail::PrefixCacheImpl>(std::move(layers), options)) {}
PrefixCache::~PrefixCache() = default;

namespace {
std::string trie_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "prefix_cache.safetensors").string();
}
detail::PrivacyRule load_rule(const char* call, const LoadOptions& options) {
  return {.call = call,
          .override_with = "set LoadOptions::allow_shared",
          .allow_shared = options.allow_shared};
}
}  // namespace

void PrefixCache::save(const std::string& dir, const std::string& model_id) const {
  save(dir, model_id, SaveOptions{});
}

void PrefixCache::save(const std::string& dir, const std::string& model_id,
                       const SaveOptions& options) const {
  const Lock lock(impl_->mutex);
  // Encoded first: a trie that cannot be saved leaves no folder behind either.
  std::string bytes;
  try {
    bytes = detail::encode_trie(impl_->trie, model_id);
  } catch (const detail::HeaderTooLong& e) {
    throw Error(fmt::format("PrefixCache::save: {}", e.what()));
  }
  const std::error_code error = detail::make_private_folders(dir);
  if (error)
    throw Error(fmt::format("PrefixCache::save: cannot create {} ({})", dir, error.message()));
  detail::check_save_folder(trie_path(dir), "PrefixCache::save", options.shared);
  detail::write_file_atomically(trie_path(dir), bytes, /*clean_stale=*/true,
                                options.shared ? 0644 : 0600);
}

void PrefixCache::load(const std::string& dir, const std::string& model_id) {
  load(dir, model_id, LoadOptions{});
}

void PrefixCache::load(const std::string& dir, const std::string& model_id,
                       const LoadOptions& options) {
  const Lock lock(impl_->mutex);
  if (impl_->any_open()) {
    throw Error(fmt::format("PrefixCache::load: a session is open on slot {}; close it first",
                            impl_->first_open()));
  }
  // The reset below would cancel another's captures on an idle slot (a Speculation round's).
  for (const auto& slot : impl_->slots) slot->require_no_schedule("PrefixCache::load");
  const std::string path = trie_path(dir);
  // Everything is read and built aside first: a load that fails leaves the trie as it was.
  std::unique_ptr<detail::Trie> fresh;
  int64_t loaded_nodes = 0, evicted = 0;
  try {
    const detail::PrivacyRule rule = load_rule("PrefixCache::load", options);
    // Read a tensor at a time: the load holds what it decodes, not the file's bytes as well, and
    // only the nodes its budget keeps. The layouts the trie holds are the ones the caches serve:
    // the file's must be the same.
    const detail::SealedRead read = [&](const detail::TensorFilter& keep) {
      detail::SealedFile file =
          detail::read_sealed_file(path, rule, detail::loadable_bytes(), keep);
      // Only now, the folder trusted: one refused is left as it is.
      detail::remove_stale_temporaries_after_load(path, rule);
      return file;
    };
    detail::LoadedTrie loaded =
        detail::read_trie(read, path, impl_->trie.layers(), model_id,
                          detail::held_signatures(impl_->trie), impl_->options.max_paged_out_bytes);
    loaded_nodes = static_cast<int64_t>(loaded.nodes.size());
    evicted = loaded.evicted;
    fresh = detail::build_trie(impl_->trie.layers(), std::move(loaded));
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("PrefixCache::load: cannot load {}: out of memory", path));
  }
  // No slot's record may name an old node once they are gone; then the old nodes go before the
  // live caches are reset, so their lazy snapshots of those caches are not copied out just to
  // be freed.
  for (const auto& slot : impl_->slots) slot->live().forget();
  impl_->trie.take_nodes(*fresh);
  std::string failed;  // a layer's reset that threw: said once the load is done
  for (size_t s = 0; s < impl_->slots.size(); ++s) {
    try {
      impl_->slots[s]->live().reset();
    } catch (const std::exception& e) {
      if (failed.empty()) {
        failed = fmt::format(
            "PrefixCache::load: loaded {}, but resetting slot {}'s layers failed "
            "({}): reset them before its next session",
            path, s, e.what());
      }
    }
  }
  impl_->stats.loaded_nodes = loaded_nodes;
  impl_->stats.evicted_nodes += evicted;
  try {
    impl_->evict(0, detail::Change::shared);  // a smaller budget than the saving cache's
  } catch (const std::bad_alloc&) {
    // The load is done; a merge while evicting ran short (the trie stays consistent, see
    // Trie::merge_into_child), and the next call's eviction goes on from here.
  }
  if (!failed.empty()) throw Error(failed);
}

bool PrefixCache::saved_in(const std::string& dir) { return saved_in(dir, LoadOptions{}); }

bool PrefixCache::saved_in(const std::string& dir, const LoadOptions& options) {
  const std::string path = trie_path(dir);
  std::error_code error;
  // Only a path that surely names nothing is "not saved": one that cannot be looked at (a folder
  // it cannot search) is opened below, which says why.
  if (!std::filesystem::exists(path, error) && !error) return false;
  // Opening it runs load's checks on the folder and the file.
  (void)detail::open_private_file(path, load_rule("PrefixCache::saved_in", options));
  return true;
}

PrefixCache::Session PrefixCache::begin(std::span<const int32_t> prompt) {
  return begin(0, prompt);
}
PrefixCache::Session PrefixCache::begin(SeqId slot, std::span<const int32_t> prompt) {
  if (impl_->options.tier != nullptr) impl_->ask_tier(slot, prompt);
  const Lock lock(impl_->mutex);
  return Session(impl_->slot(slot, "PrefixCache::begin").begin(prompt, impl_.get(), impl_->stats));
}
int64_t PrefixCache::match(std::span<const int32_t> prompt) const {
  const Lock lock(impl_->mutex);
  // A slot with nothing live: the first slot's planner with an empty view.
  const detail::Trie::Match found = impl_->trie.match(prompt);
  if (prompt.empty()) return 0;
  const int64_t limit = impl_->trie.restore_limit(found, static_cast<int64_t>(prompt.size()));
  return detail::plan_restore(impl_->trie.layers(), found.path, limit, detail::LiveView{}).target;
}
int64_t PrefixCache::match(SeqId slot, std::span<const int32_t> prompt) const {
  const Lock lock(impl_->mutex);
  return impl_->slot(slot, "PrefixCache::match").match(prompt);
}
SeqId PrefixCache::slots() const { return static_cast<SeqId>(impl_->slots.size()); }
int64_t PrefixCache::paged_out_bytes() const {
  const Lock lock(impl_->mutex);  // a load hands the trie another byte counter
  return impl_->trie.bytes();
}
int64_t PrefixCache::peak_paged_out_bytes() const {
  const Lock lock(impl_->mutex);
  return impl_->trie.peak_bytes();
}
void PrefixCache::reset_peak_paged_out_bytes() {
  const Lock lock(impl_->mutex);
  impl_->trie.reset_peak();
}
int64_t PrefixCache::recount_paged_out_bytes() const {
  const Lock lock(impl_->mutex);
  return impl_->trie.recount_bytes();
}
int64_t PrefixCache::node_count() const {
  const Lock lock(impl_->mutex);
  return impl_->trie.node_count();
}
PrefixCache::Stats PrefixCache::stats() const {
  const Lock lock(impl_->mutex);
  Stats stats = impl_->stats;
  stats.paged_out_bytes = impl_->trie.bytes();
  stats.nodes = impl_->trie.node_count();
  return stats;
}
std::string PrefixCache::debug_string() const {
  const Lock lock(impl_->mutex);
  return impl_->trie.debug_string();
}
std::string PrefixCache::check_invariants() const {
  const Lock lock(impl_->mutex);
  if (std::string problem = impl_->trie.check_invariants(); !problem.empty()) return problem;
  // A slot without a session is not written before its next call: nothing may be reserved for
  // it (its exposure would be evicted for until a session it never gets closes).
  for (const auto& slot : impl_->slots) {
    if (!slot->open() && slot->live().writable()) {
      return fmt::format("slot {} has no session open but counts as writable", slot->id());
    }
  }
  return {};
}

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
// The slot of an open, attached session (its PrefixCache's lock held by `lock`); throws Error
// naming `call` otherwise. The owner is read again under its lock: another thread's close (or
// the PrefixCache's destruction) detaches the session under that lock meanwhile.
detail::Slot& slot_of(const std::shared_ptr<detail::SessionState>& state, const char* call,
                      std::unique_lock<std::mutex>& lock) {
  detail::PrefixCacheImpl* const seen = state == nullptr ? nullptr : state->owner.load();
  if (seen != nullptr) lock = std::unique_lock(seen->mutex);
  if (state == nullptr || state->phase == detail::SessionState::Phase::closed) {
    throw Error(fmt::format("{}: the session is closed", call));  // closing detached it
  }
  detail::PrefixCacheImpl* const owner = state->owner.load();
  if (owner == nullptr) {
    throw Error(fmt::format("{}: the PrefixCache this session belongs to was destroyed", call));
  }
  return owner->slot(state->slot, call);
}
}  // namespace

std::span<const int32_t> PrefixCache::Session::remaining() const {
  std::unique_lock<std::mutex> lock;
  (void)slot_of(state_, "Session::remaining", lock);
  return std::span<const int32_t>(state_->prompt.data() + state_->cached,
                                  static_cast<size_t>(state_->prompt_length - state_->cached));
}
int64_t PrefixCache::Session::cached() const {
  std::unique_lock<std::mutex> lock;
  (void)slot_of(state_, "Session::cached", lock);
  return state_->cached;
}
SeqId PrefixCache::Session::slot() const {
  std::unique_lock<std::mutex> lock;
  (void)slot_of(state_, "Session::slot", lock);
  return state_->slot;
}
void PrefixCache::Session::schedule_snapshots(std::span<const int64_t> offsets) {
  std::unique_lock<std::mutex> lock;
  slot_of(state_, "Session::schedule_snapshots", lock).schedule_snapshots(offsets, true);
}
void PrefixCache::Session::schedule_branch_points(std::span<const int64_t> offsets) {
  std::unique_lock<std::mutex> lock;
  slot_of(state_, "Session::schedule_branch_points", lock).schedule_snapshots(offsets, false);
}
void PrefixCache::Session::prefill_done() {
  std::unique_lock<std::mutex> lock;
  slot_of(state_, "Session::prefill_done", lock).prefill_done();
}
void PrefixCache::Session::append_output(int32_t token) {
  std::unique_lock<std::mutex> lock;
  slot_of(state_, "Session::append_output", lock).append_output(token);
}
void PrefixCache::Session::retract_outputs(int64_t count) {
  std::unique_lock<std::mutex> lock;
  slot_of(state_, "Session::retract_outputs", lock).retract_outputs(count);
}
void PrefixCache::Session::close() {
  detail::PrefixCacheImpl* const owner = state_ == nullptr ? nullptr : state_->owner.load();
  if (owner == nullptr) return;
  const Lock lock(owner->mutex);
  // Closed (and detached) by another thread meanwhile: nothing left to do.
  if (state_->owner.load() != owner || state_->phase == detail::SessionState::Phase::closed) {
    return;
  }
  owner->slot(state_->slot, "Session::close").close();
}

}  // namespace kvsnap

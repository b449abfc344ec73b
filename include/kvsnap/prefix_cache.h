// PrefixCache — reuse inference state across requests that share a prefix.
//
// A compressed trie over token ids whose nodes hold per-layer snapshots: KV layers keep the
// keys/values of exactly the node's edge, whole-state layers (rotating window, recurrent) keep
// their state at the node's end. One path is active — backed by the live caches. `begin`
// finds the longest usable match, switches the live caches to it (rewinding to the common
// ancestor and paging snapshots in), aligns every layer to the deepest offset all of them can
// reach, and schedules captures for the prefill so the next request that diverges restores
// instead of recomputing. Whatever happens, outputs equal recomputation from scratch.
//
//   kvsnap::PrefixCache cache({&attention, &window, &recurrent, nullptr});
//   auto session = cache.begin(prompt);
//   model.forward(session.remaining());          // only the tokens not restored
//   session.prefill_done();
//   for (int32_t t : generate(...)) { session.append_output(t); model.forward({t}); }
//   session.close();                              // pages the reply out into the trie
//
// Speculative decoding (speculation.h): append only the tokens a round accepted (or append the
// drafts and retract_outputs() the rejected ones); close() pages out exactly the evaluated
// tokens the rolled-back layers hold, never a rejected draft. Accept or cancel a round before
// close(): a close during one pages out what the session knows (drafts appended and not yet
// retracted included — evaluated, so exact), or resets the slot when the verify forward took
// its layers past that; and begin() refuses (Error, nothing changed) a slot where a round still
// has captures scheduled.
//
// Restore points. KV layers can resume at any token; whole-state layers (window, recurrent)
// only where their state was captured, so a request resumes at the deepest offset where every
// layer can. begin() schedules captures (inside the prefill forward) at:
//   - the branch point, where the prompt leaves the trie: the next divergence there restores;
//   - the last prompt token, offset prompt.size() - 1: a regeneration of the same prompt then
//     evaluates exactly one token (a decoder needs one evaluated token for its logits);
//   - the caller's schedule_snapshots() offsets (message ends): user nodes;
//   - the caller's schedule_branch_points() offsets (where it expects other prompts to leave
//     this one): ordinary nodes.
// close() pages the evaluated tokens out with a restore point at their end; a session closed in
// the middle of its prefill keeps the captures its evaluated tokens passed. A window layer's
// restore point holds its last max_size - 1 tokens (see rotating_kv_cache.h).
//
// Many sequences: with Options::slots = N, the layers serve sequences 0..N-1 and each slot runs
// its own session (begin(slot, prompt)) over the one shared trie. A session restores from the
// trie — including nodes whose data still lives in another slot's sequence (a paged attention
// layer shares its blocks; window and recurrent states are copied or shared) — and pages its
// path out into it. match(prompt) tells a scheduler how many tokens a request would reuse,
// without changing anything.
//
// A shared tier (Options::tier, kvsnap/tier.h): when the trie cannot restore all but the last
// prompt token, begin asks the tier for a deeper restore point (waiting at most the tier's lookup
// timeout, without holding the cache's lock) and inserts what it finds into the trie; close
// hands the tier the complete restore points on the session's path, which it writes behind
// (those it already holds are skipped). A tier that fails or is slow only costs restores, never a
// request.
//
// Thread-safe: calls (sessions' too) may come from any thread and run one at a time; the
// layers lock themselves, so each slot's forward may run on its own thread.
//
// Out of memory (std::bad_alloc, or an Error saying so): a begin or close that runs out ends its
// session (the slot is free again); after an append_output that runs out, which records nothing,
// call it again; a schedule_snapshots that runs out keeps the session's earlier schedule (or, when
// even that cannot be made again, none: fewer restore points, outputs unchanged) and it goes on;
// after a prefill_done that runs out, close the session (its captures may be lost). Other slots'
// sessions go on. The trie stays consistent, and over its budget at most until the next call's
// eviction. A node that a split or merge of its snapshots ran out on loses that layer's range:
// restores stop at that node, save leaves it (and what lies below it) out, and the next request
// over those tokens inserts them again. Outputs still equal recomputation. A load that runs out
// while building the loaded trie leaves the trie as it was; one that runs out while decoding the
// file's JSON may end the process (nlohmann::json's destructors allocate).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvsnap/cache.h"
#include "kvsnap/export.h"
#include "kvsnap/persistence.h"

namespace kvsnap {

class Tier;

namespace detail {
class PrefixCacheImpl;
struct SessionState;
}  // namespace detail

class KVSNAP_EXPORT PrefixCache {
 public:
  struct Options {
    // Budget for bytes held by snapshots in the trie; least recently used leaves are evicted
    // to stay under it (user nodes last, active paths never: when only they are left, their KV
    // ranges are pointed at the live caches that hold them, then their whole-state snapshots,
    // which are restore points, are dropped). begin, prefill_done, append_output and close
    // check it before the writes that follow them: each makes room for what the open sessions'
    // forwards may copy out of the live caches into the trie's lazy snapshots
    // (Cache::exposed_bytes), so it holds between calls too. A slot without a session is not
    // written, and captures (a session's before prefill_done, a Speculation round's) are not
    // the trie's: neither is reserved. Within a call the node it inserts may exceed the budget
    // until it evicts (what a tier found goes in a segment at a time, each evicted for); only
    // what the active paths must keep can hold the trie above it.
    int64_t max_paged_out_bytes = int64_t(8) << 30;
    // Sequences (slots) the layers serve, each with at most one open session.
    SeqId slots = 1;
    // A store shared with other processes (Tier::open for these same layers), or null.
    std::shared_ptr<Tier> tier = nullptr;
  };

  // `layers` are not owned and must outlive the PrefixCache; a null entry is a stateless layer.
  // Each Cache is listed once (Error otherwise): one that several model layers share is listed
  // at one of them, null at the others. The PrefixCache drives their offsets from now on (begin
  // rewinds and restores them).
  explicit PrefixCache(std::vector<Cache*> layers);
  PrefixCache(std::vector<Cache*> layers, Options);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  class Session;
  // Starts a request for `prompt` (at least one token) on slot 0 / `slot`. Throws while that
  // slot has a session open.
  [[nodiscard]] Session begin(std::span<const int32_t> prompt);
  [[nodiscard]] Session begin(SeqId slot, std::span<const int32_t> prompt);
  // The prompt tokens begin would restore for `prompt` on a slot with nothing live (from the
  // trie alone) / on `slot` as it stands. Changes nothing (not even last-use order).
  int64_t match(std::span<const int32_t> prompt) const;
  int64_t match(SeqId slot, std::span<const int32_t> prompt) const;
  SeqId slots() const;

  // Writes the trie (edges, offsets, user flags, last-use order) and every node's snapshots to
  // `dir`/prefix_cache.safetensors, atomically, with the layers' kinds and shapes and `model_id`
  // (e.g. the model's config and weights hash; any bytes: one that is not UTF-8 is kept exactly,
  // and load compares the same bytes). The file is mode 0600 (0644 with options.shared: see
  // SaveOptions) and the folders save creates 0700, whatever the umask; an existing `dir` keeps
  // its mode. Throws Error when it cannot be written, when a layer of a cache kind kvsnap does
  // not know holds snapshots, or (without options.shared) when `dir` is a folder load would
  // refuse (another user owns it, group or others can write it): a save writes nothing then.
  void save(const std::string& dir, const std::string& model_id = "") const;
  void save(const std::string& dir, const std::string& model_id, const SaveOptions& options) const;
  // Replaces the trie by the one saved in `dir`, for the same layer configuration and model_id
  // (else a clear Error and nothing changes). The layers' kinds, windows and recurrent shapes
  // are checked, and every KV layer's snapshots must be of one layout (dtype, heads, depths) —
  // the one this trie's snapshots have, when it holds any. A reset attention cache takes any
  // layout, so a fresh trie cannot check its caches' against the file's: let `model_id` name
  // whatever shapes the state (the KV dtype, the heads a tensor-parallel rank holds), else a
  // file of another layout loads and the model's first write after a restore from it throws.
  // The live caches are reset: the next request restores from the loaded snapshots (a layer
  // whose reset throws — a custom kind — gets an Error saying the trie was loaded and which
  // slot to reset). Throws while any session is open, or while an idle slot's layers hold
  // captures no session made (an open Speculation round's: the reset would cancel them). Refuses a
  // `dir` or file that is not private to this user (see LoadOptions) unless options.allow_shared.
  // Under a smaller budget than the saving cache's, the load keeps what evicting the whole file
  // down to the budget would keep (least recently used leaves first), and reads only that: the
  // other nodes' data is checked against the file's seal as it passes, never held. Besides the
  // trie it replaces (freed once the new one is built), a load holds the snapshots it keeps (at
  // most the budget), the file's header and token edges, and a 1 MiB buffer.
  void load(const std::string& dir, const std::string& model_id = "");
  void load(const std::string& dir, const std::string& model_id, const LoadOptions& options);
  // Whether `dir` holds a saved trie. When it does, `dir` and the file are checked as load
  // checks them, and an Error is thrown for a cache that load would refuse.
  static bool saved_in(const std::string& dir);
  static bool saved_in(const std::string& dir, const LoadOptions& options);

  // Bytes owned by snapshots in the trie (lazy snapshots count once they materialize).
  int64_t paged_out_bytes() const;
  // The most paged_out_bytes() has been at any instant since the cache was made or
  // reset_peak_paged_out_bytes() last ran, counted as snapshots enter the trie and as lazy ones
  // materialize (inside calls, and during forwards on any thread): what the budget bounds.
  int64_t peak_paged_out_bytes() const;
  void reset_peak_paged_out_bytes();
  // The same total recomputed from every node's snapshots: a consistency check, O(nodes).
  int64_t recount_paged_out_bytes() const;
  // Nodes in the trie, the root excluded.
  int64_t node_count() const;

  struct Stats {
    int64_t lookups = 0;         // begin calls that opened a session
    int64_t matched_tokens = 0;  // prompt tokens found in the trie
    int64_t reused_tokens = 0;   // tokens restored instead of evaluated (sum of cached())
    int64_t evicted_nodes = 0;
    // Whole-state snapshots dropped from the active path when evicting leaves was not enough.
    int64_t dropped_snapshots = 0;
    // Nodes the last load found in the file, before the budget evicted any (evicted_nodes
    // counts those it did, unread); 0 before any load.
    int64_t loaded_nodes = 0;
    // Now, read with the counters above (at the same instant, under one lock):
    // paged_out_bytes() and node_count().
    int64_t paged_out_bytes = 0;
    int64_t nodes = 0;
  };
  Stats stats() const;

  // The trie, one node per line: edge range, a few tokens, flags and snapshot sizes.
  std::string debug_string() const;
  // Empty when the trie's invariants hold (siblings never share a first token, edges chain,
  // KV snapshots span exactly their node's edge, whole-state snapshots sit at its end, the byte
  // counter is exact, a slot without a session reserves nothing); otherwise the first
  // violation. O(nodes); for tests and debugging.
  std::string check_invariants() const;

 private:
  std::unique_ptr<detail::PrefixCacheImpl> impl_;
};

// One request's use of the prefix cache. Move-only; closes itself when destroyed. A session
// that outlives its PrefixCache is detached: its calls throw Error, closing it does nothing.
// One detached in prefill has its captures cancelled on the layers (which then serve their
// callers as before it began), so no forward over its remaining() may still be running when
// the PrefixCache goes; a schedule of the layers' own (a Speculation round's) stays.
class KVSNAP_EXPORT PrefixCache::Session {
 public:
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  ~Session();

  // The prompt tokens the model must still evaluate (never empty for an open session).
  std::span<const int32_t> remaining() const;
  // Tokens restored from the cache: the live caches now stand at this offset.
  int64_t cached() const;
  // The slot (the layers' sequence) this session runs on.
  SeqId slot() const;
  // Extra restore points (e.g. the end of the system prompt, of each message), as absolute
  // offsets in [cached(), prompt size]. They become user nodes, which resist merging and are
  // evicted last. Call before the prefill forward.
  void schedule_snapshots(std::span<const int64_t> offsets);
  // Restore points that are guesses — where other requests' prompts leave this one (a
  // scheduler's look-ahead over requests waiting to start), not boundaries the user marked:
  // captured in the same way, but ordinary nodes, evicted least recently used and merged like
  // the branch points begin schedules itself. Same offsets and timing as schedule_snapshots.
  void schedule_branch_points(std::span<const int64_t> offsets);
  // Call after the prefill forward over remaining(): attaches the captures as trie nodes.
  void prefill_done();
  // A generated token. Tokens the model has evaluated when the session closes are paged out.
  void append_output(int32_t token);
  // Takes back the last `count` generated tokens: speculative drafts appended before their
  // verification that the model rejected (see speculation.h). They are never paged out; the
  // layers must be rolled back to at most the remaining tokens before close(). Throws Error,
  // changing nothing, unless decoding, 0 <= count <= the tokens generated so far, and every
  // layer stands at or past the prompt's end.
  //
  // While a session is open its layers move forward, or back over generated tokens only: a
  // rollback never enters the prompt. The trie's nodes on the session's path name those
  // columns; re-evaluating them copies them into the trie past its budget until the session's
  // next call (outputs stay right). retract_outputs reports such a rollback when it sees one;
  // nothing else can. To go back further, close the session and begin a new one.
  void retract_outputs(int64_t count);
  // Pages the evaluated tokens out into the trie and ends the session (idempotent). Before
  // prefill_done(), the captures the evaluated tokens reached are kept and the rest dropped.
  void close();

 private:
  friend class PrefixCache;
  explicit Session(std::shared_ptr<detail::SessionState> state);
  std::shared_ptr<detail::SessionState> state_;  // null once moved from
};

}  // namespace kvsnap

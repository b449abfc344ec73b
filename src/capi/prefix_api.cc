// The C API for the prefix cache and its sessions.
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

PrefixCache& prefix_of(const kvsnap_prefix_cache* prefix, const char* call) {
  return *require(prefix, call, "prefix").prefix;
}

PrefixCache::Session& session_of(const kvsnap_session* session, const char* call) {
  // Session calls are const where the C++ ones are; the handle itself is the caller's.
  return const_cast<kvsnap_session&>(require(session, call, "session")).session;
}

kvsnap_status create(kvsnap_cache* const* layers, size_t count,
                     const kvsnap_prefix_options* options, const kvsnap_tier* tier,
                     kvsnap_prefix_cache** out, const char* call) {
  return guard(call, [&] {
    require(out, call, "out");
    std::vector<Cache*> caches = to_layers(layers, count, call);
    PrefixCache::Options settings;
    if (options != nullptr && options->max_paged_out_bytes > 0) {
      settings.max_paged_out_bytes = options->max_paged_out_bytes;
    }
    if (options != nullptr && options->slots > 0) settings.slots = options->slots;
    if (tier != nullptr) settings.tier = tier->tier;
    auto handle = std::make_unique<kvsnap_prefix_cache>();
    handle->prefix = std::make_unique<PrefixCache>(std::move(caches), settings);
    *out = handle.release();
  });
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_prefix_cache_create(kvsnap_cache* const* layers, size_t count,
                                         const kvsnap_prefix_options* options,
                                         kvsnap_prefix_cache** out) {
  return create(layers, count, options, nullptr, out, "kvsnap_prefix_cache_create");
}

kvsnap_status kvsnap_prefix_cache_create_with_tier(kvsnap_cache* const* layers, size_t count,
                                                   const kvsnap_prefix_options* options,
                                                   kvsnap_tier* tier, kvsnap_prefix_cache** out) {
  return create(layers, count, options, tier, out, "kvsnap_prefix_cache_create_with_tier");
}

void kvsnap_prefix_cache_destroy(kvsnap_prefix_cache* prefix) { delete prefix; }

kvsnap_status kvsnap_prefix_cache_begin(kvsnap_prefix_cache* prefix, const int32_t* prompt,
                                        size_t count, kvsnap_session** out) {
  constexpr const char* call = "kvsnap_prefix_cache_begin";
  return guard(call, [&] {
    PrefixCache& cache = prefix_of(prefix, call);
    require(out, call, "out");
    if (count > 0) require_data(prompt, call, "prompt");
    *out = new kvsnap_session{cache.begin({prompt, count})};
  });
}

kvsnap_status kvsnap_prefix_cache_begin_slot(kvsnap_prefix_cache* prefix, int32_t slot,
                                             const int32_t* prompt, size_t count,
                                             kvsnap_session** out) {
  constexpr const char* call = "kvsnap_prefix_cache_begin_slot";
  return guard(call, [&] {
    PrefixCache& cache = prefix_of(prefix, call);
    require(out, call, "out");
    if (count > 0) require_data(prompt, call, "prompt");
    *out = new kvsnap_session{cache.begin(slot, {prompt, count})};
  });
}

kvsnap_status kvsnap_prefix_cache_match(const kvsnap_prefix_cache* prefix, int32_t slot,
                                        const int32_t* prompt, size_t count, int64_t* out) {
  constexpr const char* call = "kvsnap_prefix_cache_match";
  return guard(call, [&] {
    const PrefixCache& cache = prefix_of(prefix, call);
    require(out, call, "out");
    if (count > 0) require_data(prompt, call, "prompt");
    const std::span<const int32_t> tokens(prompt, count);
    *out = slot < 0 ? cache.match(tokens) : cache.match(slot, tokens);
  });
}

kvsnap_status kvsnap_prefix_cache_get_stats(const kvsnap_prefix_cache* prefix,
                                            kvsnap_prefix_stats* out) {
  constexpr const char* call = "kvsnap_prefix_cache_get_stats";
  return guard(call, [&] {
    const PrefixCache& cache = prefix_of(prefix, call);
    const PrefixCache::Stats stats = cache.stats();  // one instant: the counters and the trie
    require(out, call, "out") = {
        stats.lookups,           stats.matched_tokens,  stats.reused_tokens, stats.evicted_nodes,
        stats.dropped_snapshots, stats.paged_out_bytes, stats.nodes};
  });
}

kvsnap_status kvsnap_prefix_cache_loaded_nodes(const kvsnap_prefix_cache* prefix, int64_t* out) {
  constexpr const char* call = "kvsnap_prefix_cache_loaded_nodes";
  return guard(call,
               [&] { require(out, call, "out") = prefix_of(prefix, call).stats().loaded_nodes; });
}

kvsnap_status kvsnap_prefix_cache_peak_paged_out_bytes(const kvsnap_prefix_cache* prefix,
                                                       int64_t* out) {
  constexpr const char* call = "kvsnap_prefix_cache_peak_paged_out_bytes";
  return guard(call,
               [&] { require(out, call, "out") = prefix_of(prefix, call).peak_paged_out_bytes(); });
}

kvsnap_status kvsnap_prefix_cache_reset_peak(kvsnap_prefix_cache* prefix) {
  return guard("kvsnap_prefix_cache_reset_peak", [&] {
    prefix_of(prefix, "kvsnap_prefix_cache_reset_peak").reset_peak_paged_out_bytes();
  });
}

kvsnap_status kvsnap_prefix_cache_check(const kvsnap_prefix_cache* prefix) {
  return guard("kvsnap_prefix_cache_check", [&] {
    const std::string problem = prefix_of(prefix, "kvsnap_prefix_cache_check").check_invariants();
    if (!problem.empty()) throw Error(problem);
  });
}

kvsnap_status kvsnap_session_remaining(const kvsnap_session* session, const int32_t** tokens,
                                       size_t* count) {
  constexpr const char* call = "kvsnap_session_remaining";
  return guard(call, [&] {
    const std::span<const int32_t> remaining = session_of(session, call).remaining();
    const int32_t*& first = require(tokens, call, "tokens");
    size_t& size = require(count, call, "count");  // both checked before either is written
    first = remaining.data();
    size = remaining.size();
  });
}

kvsnap_status kvsnap_session_cached(const kvsnap_session* session, int64_t* out) {
  constexpr const char* call = "kvsnap_session_cached";
  return guard(call, [&] { require(out, call, "out") = session_of(session, call).cached(); });
}

kvsnap_status kvsnap_session_slot(const kvsnap_session* session, int32_t* out) {
  constexpr const char* call = "kvsnap_session_slot";
  return guard(call, [&] { require(out, call, "out") = session_of(session, call).slot(); });
}

namespace {
// The two ways of scheduling restore points: `how` is the session's call.
kvsnap_status schedule(kvsnap_session* session, const int64_t* offsets, size_t count,
                       const char* call,
                       void (PrefixCache::Session::*how)(std::span<const int64_t>)) {
  return guard(call, [&] {
    PrefixCache::Session& s = session_of(session, call);
    if (count > 0) require_data(offsets, call, "offsets");
    (s.*how)({offsets, count});
  });
}
}  // namespace

kvsnap_status kvsnap_session_schedule_snapshots(kvsnap_session* session, const int64_t* offsets,
                                                size_t count) {
  return schedule(session, offsets, count, "kvsnap_session_schedule_snapshots",
                  &PrefixCache::Session::schedule_snapshots);
}

kvsnap_status kvsnap_session_schedule_branch_points(kvsnap_session* session, const int64_t* offsets,
                                                    size_t count) {
  return schedule(session, offsets, count, "kvsnap_session_schedule_branch_points",
                  &PrefixCache::Session::schedule_branch_points);
}

kvsnap_status kvsnap_session_prefill_done(kvsnap_session* session) {
  return guard("kvsnap_session_prefill_done",
               [&] { session_of(session, "kvsnap_session_prefill_done").prefill_done(); });
}

kvsnap_status kvsnap_session_append_output(kvsnap_session* session, int32_t token) {
  return guard("kvsnap_session_append_output",
               [&] { session_of(session, "kvsnap_session_append_output").append_output(token); });
}

kvsnap_status kvsnap_session_retract_outputs(kvsnap_session* session, int64_t count) {
  return guard("kvsnap_session_retract_outputs", [&] {
    session_of(session, "kvsnap_session_retract_outputs").retract_outputs(count);
  });
}

kvsnap_status kvsnap_session_close(kvsnap_session* session) {
  return guard("kvsnap_session_close",
               [&] { session_of(session, "kvsnap_session_close").close(); });
}

void kvsnap_session_destroy(kvsnap_session* session) { delete session; }

}  // extern "C"

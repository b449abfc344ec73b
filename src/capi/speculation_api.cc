// The C API for speculation rounds.
#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

Speculation& speculation_of(const kvsnap_speculation* speculation, const char* call) {
  return *require(speculation, call, "speculation").speculation;
}

}  // namespace

extern "C" {

kvsnap_status kvsnap_speculation_create(kvsnap_cache* const* layers, size_t count, int32_t seq,
                                        kvsnap_speculation** out) {
  constexpr const char* call = "kvsnap_speculation_create";
  return guard(call, [&] {
    require(out, call, "out");
    std::vector<Cache*> caches = to_layers(layers, count, call);
    auto handle = std::make_unique<kvsnap_speculation>();
    handle->speculation = std::make_unique<Speculation>(std::move(caches), seq);
    *out = handle.release();
  });
}

void kvsnap_speculation_destroy(kvsnap_speculation* speculation) { delete speculation; }

kvsnap_status kvsnap_speculation_begin(kvsnap_speculation* speculation, int64_t drafts) {
  return guard("kvsnap_speculation_begin",
               [&] { speculation_of(speculation, "kvsnap_speculation_begin").begin(drafts); });
}

kvsnap_status kvsnap_speculation_accept(kvsnap_speculation* speculation, int64_t accepted) {
  return guard("kvsnap_speculation_accept",
               [&] { speculation_of(speculation, "kvsnap_speculation_accept").accept(accepted); });
}

kvsnap_status kvsnap_speculation_cancel(kvsnap_speculation* speculation) {
  return guard("kvsnap_speculation_cancel",
               [&] { speculation_of(speculation, "kvsnap_speculation_cancel").cancel(); });
}

kvsnap_status kvsnap_speculation_get_round(const kvsnap_speculation* speculation, bool* open,
                                           int64_t* start, int64_t* drafts) {
  return guard("kvsnap_speculation_get_round", [&] {
    const Speculation& s = speculation_of(speculation, "kvsnap_speculation_get_round");
    if (open != nullptr) *open = s.open();
    if (start != nullptr) *start = s.start();
    if (drafts != nullptr) *drafts = s.drafts();
  });
}

kvsnap_status kvsnap_speculation_get_stats(const kvsnap_speculation* speculation,
                                           kvsnap_speculation_stats* out) {
  constexpr const char* call = "kvsnap_speculation_get_stats";
  return guard(call, [&] {
    const Speculation::Stats& stats = speculation_of(speculation, call).stats();
    require(out, call, "out") = {stats.rounds, stats.drafted, stats.accepted, stats.restores,
                                 stats.rewinds};
  });
}

}  // extern "C"

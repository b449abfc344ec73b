// The C API of the shared tier (kvsnap_c_tier.h).
#include <cstring>

#include "capi/handles.h"

using namespace kvsnap;
using namespace kvsnap::capi;

namespace {

std::string bytes(const void* data, size_t size, const char* call, const char* name) {
  if (size == 0) return {};
  require_data(data, call, name);
  return std::string(static_cast<const char*>(data), size);
}

// A duration field: milliseconds, or InvalidArgument naming it (Tier::open checks the range).
template <class Duration>
Duration duration(int64_t count, const char* call, const char* name) {
  if (count < 0) {
    throw InvalidArgument(fmt::format("{}: {} {} is negative", call, name, count));
  }
  return Duration(count);
}

TierOptions to_options(const kvsnap_tier_options& o, const char* call) {
  TierOptions options;
  options.model_fingerprint =
      bytes(o.model_fingerprint, o.model_fingerprint_size, call, "model_fingerprint");
  options.tenant = o.tenant != nullptr ? o.tenant : "";
  // A key of no bytes would open the tier unauthenticated: only NULL asks for that.
  if (o.key != nullptr && o.key_size == 0) {
    throw InvalidArgument(fmt::format(
        "{}: key is given with key_size 0; a MAC key holds at least 16 bytes (NULL: a trusted "
        "store)",
        call));
  }
  options.key = bytes(o.key, o.key_size, call, "key");
  options.chunk_tokens = o.chunk_tokens;
  options.max_object_bytes = o.max_object_bytes;
  options.max_lookup_bytes = o.max_lookup_bytes;
  using std::chrono::milliseconds;
  options.lookup_timeout = duration<milliseconds>(o.lookup_timeout_ms, call, "lookup_timeout_ms");
  options.write_timeout = duration<milliseconds>(o.write_timeout_ms, call, "write_timeout_ms");
  options.retry_interval = duration<milliseconds>(o.retry_interval_ms, call, "retry_interval_ms");
  options.ttl = duration<std::chrono::seconds>(o.ttl_seconds, call, "ttl_seconds");
  options.write_queue = o.write_queue;
  options.write_queue_bytes = o.write_queue_bytes;
  if (o.log != nullptr) {
    options.log = [log = o.log, context = o.log_context](const std::string& line) {
      log(context, line.c_str());
    };
  }
  return options;
}

// Copies `text` into `buffer` when it fits `capacity` (one more byte for a NUL when `nul`).
void hand_out(const std::string& text, void* buffer, size_t capacity, size_t* size, bool nul,
              const char* call) {
  require(size, call, "size");
  const size_t need = text.size() + (nul ? 1 : 0);
  // A buffer too small reports the size it needs (NULL with capacity 0 asks for it); any other
  // failure leaves *size as it was.
  if (capacity >= need) require_data(buffer, call, "buffer");
  *size = text.size();
  if (capacity < need) {
    throw InvalidArgument(
        fmt::format("{}: a buffer of {} bytes; it needs {}", call, capacity, need));
  }
  std::memcpy(buffer, text.data(), text.size());
  if (nul) static_cast<char*>(buffer)[text.size()] = '\0';
}

}  // namespace

extern "C" {

kvsnap_tier_options kvsnap_tier_options_default(void) {
  const TierOptions d;
  kvsnap_tier_options o{};
  o.chunk_tokens = d.chunk_tokens;
  o.max_object_bytes = d.max_object_bytes;
  o.max_lookup_bytes = d.max_lookup_bytes;
  o.lookup_timeout_ms = d.lookup_timeout.count();
  o.write_timeout_ms = d.write_timeout.count();
  o.retry_interval_ms = d.retry_interval.count();
  o.ttl_seconds = d.ttl.count();
  o.write_queue = d.write_queue;
  o.write_queue_bytes = d.write_queue_bytes;
  return o;
}

kvsnap_status kvsnap_tier_open(const char* address, kvsnap_cache* const* layers, size_t count,
                               const kvsnap_tier_options* options, kvsnap_tier** out) {
  constexpr const char* call = "kvsnap_tier_open";
  return guard(call, [&] {
    require(address, call, "address");
    require(options, call, "options");
    require(out, call, "out");
    std::vector<Cache*> caches = to_layers(layers, count, call);
    auto handle = std::make_unique<kvsnap_tier>();
    handle->tier = Tier::open(address, std::move(caches), to_options(*options, call));
    handle->address = handle->tier->address();
    *out = handle.release();
  });
}

void kvsnap_tier_destroy(kvsnap_tier* tier) { delete tier; }

kvsnap_status kvsnap_tier_get_stats(const kvsnap_tier* tier, kvsnap_tier_stats* out) {
  constexpr const char* call = "kvsnap_tier_get_stats";
  return guard(call, [&] {
    const TierStats s = require(tier, call, "tier").tier->stats();
    require(out, call, "out") = {s.lookups,         s.hits,
                                 s.restored_tokens, s.bytes_read,
                                 s.bytes_written,   s.timeouts,
                                 s.rejected,        s.unauthenticated,
                                 s.objects_written, s.dropped_batches,
                                 s.store_errors,    s.caller_microseconds};
  });
}

kvsnap_status kvsnap_tier_flush(kvsnap_tier* tier, int64_t timeout_ms, bool* drained) {
  constexpr const char* call = "kvsnap_tier_flush";
  return guard(call, [&] {
    Tier& t = *require(tier, call, "tier").tier;
    require(drained, call, "drained");
    *drained = t.flush(duration<std::chrono::milliseconds>(timeout_ms, call, "timeout_ms"));
  });
}

const char* kvsnap_tier_address(const kvsnap_tier* tier) {
  return tier == nullptr ? nullptr : tier->address.c_str();
}

bool kvsnap_tier_authenticated(const kvsnap_tier* tier) {
  return tier != nullptr && tier->tier->authenticated();
}

kvsnap_status kvsnap_load_tier_key(const char* path, void* buffer, size_t capacity, size_t* size) {
  constexpr const char* call = "kvsnap_load_tier_key";
  return guard(call, [&] {
    require(path, call, "path");
    hand_out(load_tier_key(path), buffer, capacity, size, /*nul=*/false, call);
  });
}

kvsnap_status kvsnap_load_tier_address(const char* path, char* buffer, size_t capacity,
                                       size_t* size) {
  constexpr const char* call = "kvsnap_load_tier_address";
  return guard(call, [&] {
    require(path, call, "path");
    hand_out(load_tier_address(path), buffer, capacity, size, /*nul=*/true, call);
  });
}

}  // extern "C"

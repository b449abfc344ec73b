#include "tier/store.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "kvsnap/error.h"
#include "tier/dir_store.h"
#include "tier/redis_store.h"

namespace kvsnap::detail {

void StoreHealth::failed(const std::string& why, bool lost) {
  const std::lock_guard<std::mutex> lock(mutex_);
  lost_ = lost_ || lost;
  if (down_) return;
  down_ = true;
  log_(fmt::format("{} is unavailable ({}); requests go on without it", address_, why));
}

void StoreHealth::answered() {
  bool lost = false;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!down_) return;
    down_ = false;
    lost = std::exchange(lost_, false);
  }
  log_(fmt::format("{} answers again", address_));
  if (lost) back_();
}

void StoreHealth::writes_refused(const std::string& why) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (std::exchange(refusing_writes_, true)) return;
  log_(fmt::format("{} refuses writes ({}); sessions are not stored until it takes them again",
                   address_, why));
}

void StoreHealth::writes_taken() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!std::exchange(refusing_writes_, false)) return;
  }
  log_(fmt::format("{} takes writes again", address_));
}

TierStats TierCounters::stats() const {
  TierStats s;
  s.lookups = lookups;
  s.hits = hits;
  s.restored_tokens = restored_tokens;
  s.bytes_read = bytes_read;
  s.bytes_written = bytes_written;
  s.timeouts = timeouts;
  s.rejected = rejected;
  s.unauthenticated = unauthenticated;
  s.objects_written = objects_written;
  s.dropped_batches = dropped_batches;
  s.store_errors = store_errors;
  s.caller_microseconds = caller_microseconds;
  return s;
}

namespace {
constexpr std::string_view kDir = "dir:";
}  // namespace

void check_store_address(const std::string& address) {
  if (address.rfind(kDir, 0) == 0) {
    if (address.size() == kDir.size()) {
      throw Error(fmt::format("tier address {}: the folder after dir: is empty", address));
    }
    return;
  }
  (void)parse_redis_address(address);
}

std::string redact_address(const std::string& address) {
  if (address.rfind(kDir, 0) == 0) return address;  // a path: nothing secret, '@' or not
  const size_t scheme = address.find("://");
  const size_t at = address.rfind('@');
  if (at == std::string::npos) {
    // No '@': a password written without it stands where the port would ("redis://:secret",
    // "redis://user:secret"); anything after the host's ':' but digits is hidden.
    const size_t start = scheme == std::string::npos ? 0 : scheme + 3;
    const size_t end = std::min(address.find('/', start), address.size());
    const size_t colon = address.rfind(':', end);
    if (colon == std::string::npos || colon < start || colon + 1 >= end) return address;
    const std::string_view port(address.data() + colon + 1, end - colon - 1);
    if (std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return address;
    }
    return address.substr(0, colon + 1) + "***" + address.substr(end);
  }
  // Whatever stands between the scheme (any, or none) and the last '@' may be a password: only
  // a user name before a ':' stays.
  const size_t start = scheme != std::string::npos && scheme < at ? scheme + 3 : 0;
  const size_t colon = address.find(':', start);
  const size_t keep = colon != std::string::npos && colon < at ? colon + 1 : start;
  return address.substr(0, keep) + "***" + address.substr(at);
}

std::unique_ptr<Store> open_store(const std::string& address, const StoreOptions& options) {
  check_store_address(address);
  if (address.rfind(kDir, 0) == 0) {
    return std::make_unique<DirStore>(address.substr(kDir.size()), options.own_files_only,
                                      options.ttl, options.health);
  }
  return std::make_unique<RedisStore>(parse_redis_address(address), options);
}

}  // namespace kvsnap::detail

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
    // "redis://user:secret"), and where the database would from a '/' in it ("redis://user:
    // se/cret"): whatever is not digits after the host's ':' is hidden from there to the end,
    // and so is a database that is not digits.
    const auto digits = [](std::string_view text) {
      return std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    const size_t start = scheme == std::string::npos ? 0 : scheme + 3;
    const size_t slash = std::min(address.find('/', start), address.size());
    const size_t colon = address.rfind(':', slash == address.size() ? slash : slash - 1);
    const size_t bracket = address.rfind(']', slash == address.size() ? slash : slash - 1);
    const bool port = colon != std::string::npos && colon >= start &&
                      (bracket == std::string::npos || bracket < start || colon > bracket);
    if (port && !digits(std::string_view(address).substr(colon + 1, slash - colon - 1))) {
      return address.substr(0, colon + 1) + "***";
    }
    if (slash < address.size() && !digits(std::string_view(address).substr(slash + 1))) {
      return address.substr(0, slash + 1) + "***";
    }
    return address;
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

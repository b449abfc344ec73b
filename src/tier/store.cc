#include "tier/store.h"

#include <fmt/format.h>

#include "kvsnap/error.h"
#include "tier/dir_store.h"
#include "tier/redis_store.h"

namespace kvsnap::detail {

void StoreHealth::failed(const std::string& why) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (down_) return;
  down_ = true;
  log_(fmt::format("{} is unavailable ({}); requests go on without it", address_, why));
}

void StoreHealth::answered() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!down_) return;
    down_ = false;
  }
  log_(fmt::format("{} answers again", address_));
  back_();
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
  const std::string scheme = "redis://";
  const size_t at = address.rfind('@');
  if (address.rfind(scheme, 0) != 0 || at == std::string::npos) return address;
  const size_t colon = address.find(':', scheme.size());
  if (colon == std::string::npos || colon > at) return address;
  return address.substr(0, colon + 1) + "***" + address.substr(at);
}

std::unique_ptr<Store> open_store(const std::string& address, const StoreOptions& options) {
  check_store_address(address);
  if (address.rfind(kDir, 0) == 0) {
    return std::make_unique<DirStore>(address.substr(kDir.size()));
  }
  return std::make_unique<RedisStore>(parse_redis_address(address), options);
}

}  // namespace kvsnap::detail

#include "kvsnap/tier.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cache/snapshot_record.h"
#include "tier/object.h"
#include "tier/tier_impl.h"

namespace kvsnap {
namespace detail {
namespace {

// The length of the well-formed UTF-8 sequence at line[i] (no overlong forms, surrogates or
// code points past U+10FFFF), or 0.
size_t utf8_length(const std::string& line, size_t i) {
  const auto byte = [&](size_t k) {
    return i + k < line.size() ? static_cast<unsigned char>(line[i + k]) : 0;
  };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // the second byte's range
  if (lead >= 0xc2 && lead <= 0xdf) length = 2;
  if (lead >= 0xe0 && lead <= 0xef) length = 3;
  if (lead >= 0xf0 && lead <= 0xf4) length = 4;
  if (lead == 0xe0) low = 0xa0;
  if (lead == 0xed) high = 0x9f;
  if (lead == 0xf0) low = 0x90;
  if (lead == 0xf4) high = 0x8f;
  if (length == 0 || byte(1) < low || byte(1) > high) return 0;
  for (size_t k = 2; k < length; ++k) {
    if (byte(k) < 0x80 || byte(k) > 0xbf) return 0;
  }
  return length;
}

// `line` with its control characters written as \xNN, byte by byte: C0 and DEL, the UTF-8 of
// C1 (U+0080..U+009F, NEL among them) and of U+2028 / U+2029, which some readers also end a
// line at, and every byte that is not part of well-formed UTF-8 (a lone 0x9B is CSI to a
// terminal reading 8-bit controls). Text the store sent (an object's key, a server's error)
// cannot start a line of its own or steer the terminal; other UTF-8 passes unchanged.
std::string one_line(const std::string& line) {
  std::string out;
  out.reserve(line.size());
  const auto byte = [&](size_t i) {
    return i < line.size() ? static_cast<unsigned char>(line[i]) : 0;
  };
  for (size_t i = 0; i < line.size(); ++i) {
    const unsigned char c = byte(i);
    size_t escaped = 0;  // bytes to write as \xNN from here
    if (c < 0x20 || c == 0x7f || utf8_length(line, i) == 0) escaped = 1;
    if (c == 0xc2 && byte(i + 1) >= 0x80 && byte(i + 1) <= 0x9f) escaped = 2;
    if (c == 0xe2 && byte(i + 1) == 0x80 && (byte(i + 2) == 0xa8 || byte(i + 2) == 0xa9)) {
      escaped = 3;
    }
    if (escaped == 0) {  // a well-formed sequence, whole
      const size_t length = utf8_length(line, i);
      out.append(line, i, length);
      i += length - 1;
      continue;
    }
    for (size_t k = 0; k < escaped; ++k) out += fmt::format("\\x{:02X}", byte(i + k));
    i += escaped - 1;
  }
  return out;
}

TierOptions checked(const std::vector<Cache*>& layers, TierOptions options) {
  const auto fail = [](const std::string& rule) { return Error("Tier::open: " + rule); };
  if (options.model_fingerprint.empty()) {
    throw fail("the model fingerprint is empty (states of another model must never restore)");
  }
  // A chunk's index lists a restore point per offset, twice where two versions wrote it: it
  // must stay within what a probe reads of one.
  constexpr int64_t kMostChunkTokens = Store::kMaximumIndexMembers / 2;
  if (options.chunk_tokens < 1 || options.chunk_tokens > kMostChunkTokens) {
    throw fail(
        fmt::format("chunk_tokens {} must be in [1, {}]", options.chunk_tokens, kMostChunkTokens));
  }
  if (!options.key.empty() && options.key.size() < 16) {
    throw fail(fmt::format("a key of {} bytes is too short (at least 16)", options.key.size()));
  }
  if (options.write_queue_bytes < 1) {
    throw fail(fmt::format("write_queue_bytes {} must be >= 1", options.write_queue_bytes));
  }
  if (options.max_object_bytes < 1 || options.max_object_bytes > Store::kMaximumObjectBytes) {
    throw fail(fmt::format("max_object_bytes {} must be in [1, {}]", options.max_object_bytes,
                           Store::kMaximumObjectBytes));
  }
  if (options.max_lookup_bytes < 1 || options.max_lookup_bytes > (int64_t(1) << 50)) {
    throw fail(fmt::format("max_lookup_bytes {} must be in [1, 2^50]", options.max_lookup_bytes));
  }
  if (options.write_queue < 1) {
    throw fail(fmt::format("write_queue {} must be >= 1", options.write_queue));
  }
  // At most a day: deadlines are now + timeout on the steady clock, where milliseconds::max()
  // (a "no limit") overflowed into a deadline long past.
  constexpr std::chrono::milliseconds kDay = std::chrono::hours(24);
  const auto in_range = [&](std::chrono::milliseconds t) { return t.count() >= 0 && t <= kDay; };
  // The ttl at most 100 years: Redis refuses an expiry whose milliseconds from now overflow,
  // and every command would fail as if the store were down.
  constexpr std::chrono::seconds kCentury = std::chrono::hours(24 * 36525);
  if (!in_range(options.lookup_timeout) || !in_range(options.write_timeout) ||
      !in_range(options.retry_interval) || options.ttl.count() < 1 || options.ttl > kCentury) {
    throw fail(fmt::format(
        "lookup_timeout {} ms, write_timeout {} ms, retry_interval {} ms, ttl {} s: timeouts and "
        "the retry interval must be in [0, 24 h], the ttl in [1 s, 100 years]",
        options.lookup_timeout.count(), options.write_timeout.count(),
        options.retry_interval.count(), options.ttl.count()));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (describe_layer(layers[i]) == R"({"kind":"other"})") {
      throw fail(fmt::format("layer {} is a cache kind the tier cannot store", i));
    }
  }
  if (!options.log) {
    options.log = [](const std::string& line) { fmt::print(stderr, "kvsnap tier: {}\n", line); };
  }
  options.log = [log = std::move(options.log)](const std::string& line) {
    try {
      log(one_line(line));
    } catch (...) {  // a log that fails (stderr closed, a throwing callback) loses its line only
    }
  };
  return options;
}

}  // namespace

bool KnownKeys::contains(const std::string& key) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return keys_.count(key) > 0;
}

void KnownKeys::add(const std::vector<std::string>& keys) {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (keys_.size() + keys.size() > kMaximum) keys_.clear();  // forgetting only costs a rewrite
  keys_.insert(keys.begin(), keys.end());
}

void KnownKeys::erase(const std::string& key) {
  const std::lock_guard<std::mutex> lock(mutex_);
  keys_.erase(key);
}

void KnownKeys::clear() {
  const std::lock_guard<std::mutex> lock(mutex_);
  keys_.clear();
}

TierImpl::TierImpl(const std::string& address, std::vector<Cache*> layers, TierOptions options)
    : address_(redact_address(address)),
      layers_(std::move(layers)),
      options_(checked(layers_, std::move(options))),
      mac_key_(options_.key.empty() ? "" : derive_mac_key(options_.key)),
      keys_(options_.model_fingerprint, tier_layer_configuration(layers_), options_.tenant,
            options_.chunk_tokens, tier_scope(address, mac_key_)),
      signatures_(layers_.size()) {
  // A store that was lost may come back empty (restarted, flushed): write everything again.
  StoreOptions store_options{
      options_.ttl, options_.retry_interval,
      std::make_shared<StoreHealth>(address_, options_.log, [this] { known_.clear(); }),
      /*own_files_only=*/mac_key_.empty()};
  // A chunk's index lists one point per offset of the chunk, once per object size written there
  // (processes whose layers differ in shapes the root does not bind share it; the version before
  // sizes wrote bare members): a Redis set listing more than 16 per offset (planted) fails its
  // probe as it arrives, so a probe of many sets costs a bounded share each, not the megabytes
  // of kMaximumIndexMembers.
  store_options.max_index_members =
      std::min(Store::kMaximumIndexMembers, 16 * options_.chunk_tokens);
  lookup_store_ = open_store(address, store_options);
  WriteBehind::Options writer;
  writer.capacity = static_cast<size_t>(options_.write_queue);
  writer.capacity_bytes = options_.write_queue_bytes;
  writer.write_timeout = options_.write_timeout;
  writer.lookup_timeout = options_.lookup_timeout;
  writer.mac_key = mac_key_;
  writer.written = [this](const std::vector<std::string>& keys) { known_.add(keys); };
  writer.lost = [this] {
    known_.clear();
    if (logged_loss_.exchange(true)) return;  // the first time only: an evicting store loses often
    options_.log(fmt::format(
        "{}: the store lost objects this process wrote or read (flushed, restarted, evicted or "
        "expired): the next sessions write them again (logged the first time only)",
        address_));
  };
  writer.known = [this](const std::string& key) { return known_.contains(key); };
  writer.unusable_index = [this](const UnusableIndex& failure) { drop_index(failure); };
  // The writer is off the request path: while the host name resolves, its batches wait for the
  // resolution (within their write timeout) instead of being dropped.
  store_options.wait_for_resolution = true;
  writer_ = std::make_unique<WriteBehind>(open_store(address, store_options), writer, counters_);
  if (mac_key_.empty()) {
    options_.log(
        fmt::format("{}: no key (TierOptions::key, --tier-key-file): trusted-store mode — objects "
                    "are checked for damage, not "
                    "for authenticity; whoever can write the store can plant state",
                    address_));
  }
}

bool TierImpl::ranged(size_t layer) const {
  return layers_[layer] != nullptr &&
         layers_[layer]->restore_rule().kind == RestoreRule::Kind::ranges;
}

void TierImpl::reject(const std::string& key, size_t bytes, const std::string& why,
                      bool unauthenticated, bool doom) {
  ++counters_.rejected;
  if (unauthenticated) ++counters_.unauthenticated;
  known_.erase(key);
  if (doom) writer_->doom(key);
  constexpr int64_t kMaximumLines = 100;
  const int64_t line = ++logged_rejections_;
  if (line <= kMaximumLines) {
    options_.log(
        fmt::format("rejected {} ({} bytes): {}{}", key, bytes, why,
                    line == kMaximumLines ? " (further rejections are only counted)" : ""));
  }
}

void TierImpl::drop_index(const UnusableIndex& failure) {
  reject(failure.set, 0, failure.what(), /*unauthenticated=*/false, /*doom=*/true);
  known_.clear();
}

std::vector<std::string> TierImpl::known_signatures() const {
  const std::lock_guard<std::mutex> lock(signatures_mutex_);
  return signatures_;
}

void TierImpl::learn_signature(size_t layer, const SnapshotRecord& record) {
  const std::lock_guard<std::mutex> lock(signatures_mutex_);
  if (signatures_[layer].empty()) {
    signatures_[layer] = snapshot_signature(record, layers_[layer]);
  }
}

}  // namespace detail

std::shared_ptr<Tier> Tier::open(const std::string& address, std::vector<Cache*> layers,
                                 TierOptions options) {
  return std::shared_ptr<Tier>(
      new Tier(std::make_unique<detail::TierImpl>(address, std::move(layers), std::move(options))));
}

void Tier::check_address(const std::string& address) { detail::check_store_address(address); }

Tier::Tier(std::unique_ptr<detail::TierImpl> impl) : impl_(std::move(impl)) {}
Tier::~Tier() = default;

TierMatch Tier::lookup(std::span<const int32_t> tokens, int64_t limit, int64_t better_than,
                       int64_t max_bytes) {
  return impl_->lookup(tokens, limit, better_than, max_bytes);
}
void Tier::store(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
                 std::span<const TierPoint> points) {
  impl_->store(tokens, ranges, points);
}
bool Tier::offer(std::span<const int32_t> tokens, std::span<const Snapshot* const> ranges,
                 std::span<const TierPoint> points) noexcept {
  return impl_->offer(tokens, ranges, points);
}
bool Tier::offer(std::span<const int32_t> tokens,
                 const std::function<std::vector<SnapshotPtr>()>& take_ranges,
                 std::span<const TierPoint> points) noexcept {
  return impl_->offer(tokens, take_ranges, points);
}
bool Tier::flush(std::chrono::milliseconds timeout) { return impl_->flush(timeout); }
TierStats Tier::stats() const { return impl_->stats(); }
const std::vector<Cache*>& Tier::layers() const { return impl_->layers(); }
std::string Tier::address() const { return impl_->address(); }
bool Tier::authenticated() const { return impl_->authenticated(); }

}  // namespace kvsnap

// Tier tests: the store a test's "processes" share (a folder or a real redis-server), the test's
// own hands on its objects (to damage, copy or remove them), and an engine process — a hybrid
// stack, its prefix cache and its own tier connection, every output checked against
// recomputation (run_turn).
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "support/conversation.h"
#include "support/redis_server.h"
#include "tier/keys.h"

namespace kvsnap::testing {

// Store::fetch's bytes for a fetch the test does not bound.
inline constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// Lines a tier logged.
class LogLines {
 public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      const std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(line);
    };
  }
  int64_t count(const std::string& fragment) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return std::count_if(lines_.begin(), lines_.end(), [&](const std::string& line) {
      return line.find(fragment) != std::string::npos;
    });
  }
  std::string all() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    for (const std::string& line : lines_) out += line + "\n";
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
};

// Options for the hybrid stack's tier: 8-token chunks so short prompts span several; generous
// timeouts (sanitizer builds are slow) except where a test is about them.
inline TierOptions tier_options(const std::string& tenant = "", const std::string& key = "") {
  TierOptions options;
  options.model_fingerprint = "tests/support hybrid stack";
  options.tenant = tenant;
  options.key = key;
  options.chunk_tokens = 8;
  options.lookup_timeout = std::chrono::milliseconds(2000);
  options.write_timeout = std::chrono::milliseconds(2000);
  options.retry_interval = std::chrono::milliseconds(20);
  return options;
}

// One engine process.
class TierProcess {
 public:
  // `budget`: the prefix cache's max_paged_out_bytes.
  TierProcess(const std::string& address, TierOptions options = tier_options(),
              int64_t budget = PrefixCache::Options{}.max_paged_out_bytes)
      : tier(Tier::open(address, stack.layers(), with_log(std::move(options)))),
        cache(stack.layers(), {.max_paged_out_bytes = budget, .tier = tier}) {}

  // A request checked against recomputation; its writes are flushed before it returns.
  Turn turn(const Tokens& prompt, const Tokens& reply, const std::vector<int64_t>& ends = {}) {
    const Turn done = run_turn(cache, stack, prompt, reply, ends);
    EXPECT_TRUE(tier->flush());
    return done;
  }

  HybridStack stack;
  LogLines log;
  std::shared_ptr<Tier> tier;
  PrefixCache cache;

 private:
  TierOptions with_log(TierOptions options) {
    options.log = log.sink();
    return options;
  }
};

// A conversation on a 20-token system prompt: the first turn (27 prompt tokens, 5 reply tokens)
// leaves restore points at 20 (end of the system prompt), 26 (last prompt token) and 31 (what the
// reply evaluated); the second turn continues it.
struct Conversation {
  Tokens system = tokens(100, 20);
  Tokens first = system + tokens(200, 7);
  Tokens reply = tokens(300, 5);
  Tokens second = first + reply + tokens(400, 6);
  std::vector<int64_t> ends = {20};
};

// The names a tier of `options` gives the objects of `prompt` (the hybrid stack's layers).
class ObjectNames {
 public:
  // `address`: the store's (names of a dir: store without a key are this user's).
  explicit ObjectNames(const TierOptions& options = tier_options(), const std::string& address = "")
      : chunk_(options.chunk_tokens) {
    HybridStack stack;
    keys_ = std::make_unique<detail::TierKeys>(
        options.model_fingerprint, detail::tier_layer_configuration(stack.layers()), options.tenant,
        options.chunk_tokens,
        detail::tier_scope(address,
                           options.key.empty() ? "" : detail::derive_mac_key(options.key)));
  }
  // The restore point at `offset` of `prompt`.
  std::string point(const Tokens& prompt, int64_t offset) const {
    const int64_t base = offset / chunk_;
    const auto chain = keys_->chain(prompt, base);
    return detail::TierKeys::point_key(
        chain.back(), offset,
        std::span(prompt).subspan(static_cast<size_t>(base * chunk_),
                                  static_cast<size_t>(offset - base * chunk_)));
  }
  // The KV chunk j of `prompt`.
  std::string chunk(const Tokens& prompt, int64_t j) const {
    return detail::TierKeys::chunk_key(keys_->chain(prompt, j + 1).back());
  }
  // The index of the restore points of `prompt` in [j * chunk, (j + 1) * chunk).
  std::string index(const Tokens& prompt, int64_t j) const {
    return detail::TierKeys::index_key(keys_->chain(prompt, j).back());
  }

 private:
  int64_t chunk_;
  std::unique_ptr<detail::TierKeys> keys_;
};

// The store a test's processes share, and the test's hands on its objects.
class TestStore {
 public:
  virtual ~TestStore() = default;
  virtual std::string address() const = 0;
  // Key names starting with `prefix` ("kvsnap:c:" chunks, "kvsnap:p:" points, "kvsnap:i:").
  virtual std::vector<std::string> keys(const std::string& prefix) const = 0;
  virtual std::string get(const std::string& key) const = 0;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual void remove(const std::string& key) = 0;
  // An index set's members (sorted), and replacing them.
  virtual std::vector<std::string> members(const std::string& set) const = 0;
  virtual void set_members(const std::string& set, const std::vector<std::string>& members) = 0;
};

class FolderStore final : public TestStore {
 public:
  explicit FolderStore(const std::string& name)
      : folder_(std::filesystem::temp_directory_path() /
                ("kvsnap_tier_" + std::to_string(::getpid()) + "_" + name)) {
    std::filesystem::remove_all(folder_);
  }
  ~FolderStore() override { std::filesystem::remove_all(folder_); }
  std::string address() const override { return "dir:" + folder_.string(); }
  std::vector<std::string> keys(const std::string& prefix) const override {
    std::vector<std::string> out;
    if (!std::filesystem::exists(folder_)) return out;
    for (const auto& entry : std::filesystem::directory_iterator(folder_)) {
      std::string name = entry.path().filename().string();
      std::replace(name.begin(), name.end(), '-', ':');
      if (name.rfind(prefix, 0) == 0) out.push_back(name);
    }
    return out;
  }
  std::string get(const std::string& key) const override {
    std::ifstream in(path(key), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  void set(const std::string& key, const std::string& value) override {
    std::ofstream(path(key), std::ios::binary | std::ios::trunc) << value;
  }
  void remove(const std::string& key) override { std::filesystem::remove_all(path(key)); }
  std::vector<std::string> members(const std::string& set) const override {
    std::vector<std::string> out;
    for (const auto& entry : std::filesystem::directory_iterator(path(set))) {
      out.push_back(entry.path().filename().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  void set_members(const std::string& set, const std::vector<std::string>& members) override {
    std::filesystem::remove_all(path(set));
    std::filesystem::create_directory(path(set));
    std::filesystem::permissions(path(set), std::filesystem::perms::owner_all);
    for (const std::string& member : members) std::ofstream(path(set) / member);
  }

 private:
  std::filesystem::path path(std::string key) const {
    std::replace(key.begin(), key.end(), ':', '-');
    return folder_ / key;
  }
  std::filesystem::path folder_;
};

class RedisStore final : public TestStore {
 public:
  explicit RedisStore(RedisServer::Options options = {}) : server(std::move(options)) {}
  std::string address() const override { return server.address(); }
  std::vector<std::string> keys(const std::string& prefix) const override {
    std::vector<std::string> out = server.keys(prefix + "*");
    std::erase(out, "");
    return out;
  }
  std::string get(const std::string& key) const override { return server.command({"GET", key}); }
  void set(const std::string& key, const std::string& value) override {
    (void)server.command({"SET", key, value});
  }
  void remove(const std::string& key) override { (void)server.command({"DEL", key}); }
  std::vector<std::string> members(const std::string& set) const override {
    std::vector<std::string> out = server.keys_of({"SMEMBERS", set});
    std::sort(out.begin(), out.end());
    return out;
  }
  void set_members(const std::string& set, const std::vector<std::string>& members) override {
    remove(set);
    std::vector<std::string> add{"SADD", set};
    add.insert(add.end(), members.begin(), members.end());
    (void)server.command(add);
  }

  RedisServer server;
};

inline std::unique_ptr<TestStore> make_store(const std::string& kind, const std::string& name) {
  if (kind == "dir") return std::make_unique<FolderStore>(name);
  return std::make_unique<RedisStore>();
}

}  // namespace kvsnap::testing

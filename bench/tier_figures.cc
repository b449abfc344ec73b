// `kvsnap bench`: the shared tier's cost to the request that stores — a session closing over a
// long paged context writes its new chunk (and restore point), whatever the context before it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "figure_parts.h"

namespace kvsnap::bench {

// Tier::store of one new 256-token chunk and its restore point over a paged sequence of 4k and
// 32k tokens (the earlier chunks already stored), against memcpy of the chunk's bytes: what the
// caller pays (the write itself is the write-behind's). The object's tokens are copied from the
// blocks that hold them, so the figure must not grow with the context's KV data (what grows is
// the keys' hashing of the prompt, 4 bytes a token: here 1/1024 of its KV bytes, for a model of
// 32 such layers 1/32768).
void tier_figures(std::vector<Figure>& out, const Shape& shape) {
  constexpr int64_t kChunk = 256;  // the tier's chunk size
  const auto folder =
      std::filesystem::temp_directory_path() / fmt::format("kvsnap_bench_tier_{}", ::getpid());
  const Chunk chunk(shape, kChunk);
  Writer writer(kChunk);
  for (int64_t context : {sized(4096, 2 * kChunk), sized(32768, 2 * kChunk)}) {
    std::filesystem::remove_all(folder);
    PagedKVCache paged({.block_tokens = 16});
    const std::vector<Cache*> layers{&paged};
    TierOptions options;
    options.model_fingerprint = "bench";
    options.log = [](const std::string&) {};  // its trusted-store notice is not a figure
    const std::shared_ptr<Tier> tier = Tier::open("dir:" + folder.string(), layers, options);
    std::vector<int32_t> tokens;
    const auto append = [&] {
      writer.write(paged, chunk);
      tokens.resize(static_cast<size_t>(paged.offset()));
      std::iota(tokens.end() - kChunk, tokens.end(), static_cast<int32_t>(tokens.size() - kChunk));
    };
    const auto store = [&] {
      const SnapshotPtr range = paged.snapshot(0);
      const std::vector<const Snapshot*> ranges{range.get()};
      const TierPoint point{paged.offset(), {nullptr}};
      tier->store(tokens, ranges, {&point, 1});
    };
    while (paged.offset() < context) append();
    // Every chunk so far, known to this process from now on: written, or the figure would time
    // the encoding of them all again.
    const auto flushed = [&] {
      if (!tier->flush(std::chrono::seconds(60)) || tier->stats().dropped_batches > 0 ||
          tier->stats().store_errors > 0) {
        throw Error(fmt::format(
            "kvsnap bench: the tier figure's store ({}) did not take its writes", folder.string()));
      }
    };
    store();
    flushed();
    double best = 1e300;
    for (int round = 0; round < 8; ++round) {
      append();
      const auto start = Clock::now();
      store();
      best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - start).count());
      flushed();
    }
    const int64_t bytes = kChunk * shape.token_bytes();
    const double ratio = best / memcpy_ns(bytes);
    out.push_back({"tier store, paged sequence",
                   fmt::format("one new chunk after {}k tokens", context / 1024), best / 1e3, "us",
                   ratio, "x memcpy of the chunk", "<= 25", ratio <= 25,
                   fmt::format("{:.0f} KiB per chunk, dir: store", bytes / 1024.0)});
  }
  std::filesystem::remove_all(folder);
}

}  // namespace kvsnap::bench

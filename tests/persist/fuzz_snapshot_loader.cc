// libFuzzer target for kvsnap's file loaders (snapshot files and saved prefix-cache tries): any
// input must either load or be rejected with kvsnap::Error — never crash, hang, leak or throw
// anything else.
//
// With KVSNAP_FUZZ_SEED=dir set, writes one valid file of each kind there (the seed corpus)
// and exits.
#include <kvsnap/kvsnap.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "prefix/trie_file.h"

namespace {

// The layers every fuzzed trie is checked against (and the seed was saved with): KV,
// recurrent, stateless.
kvsnap::KVCache attention;
kvsnap::RecurrentCache recurrent(2, 3, 1, 2, 2);

const std::vector<kvsnap::detail::LayerInfo>& fuzz_layers() {
  static const std::vector<kvsnap::detail::LayerInfo> layers{{&attention, attention.restore_rule()},
                                                             {&recurrent, recurrent.restore_rule()},
                                                             {nullptr, {}}};
  return layers;
}

// One forward of `length` tokens through both caches.
void forward(int64_t length) {
  const auto batch = kvsnap::Batch::uniform(1, length, attention.offset());
  const std::vector<float> values(static_cast<size_t>(2 * length * 2), 0.5f);
  (void)attention.update(batch,
                         kvsnap::Array::from_floats(values, {1, 2, length, 2}, kvsnap::DType::f16),
                         kvsnap::Array::from_floats(values, {1, 2, length, 2}, kvsnap::DType::f16));
  (void)recurrent.get(batch, kvsnap::DType::f32);
  const size_t states = recurrent.snapshot_splits(length).size() + 1;
  const std::vector<kvsnap::Array> conv(states,
                                        kvsnap::Array::zeros(kvsnap::DType::f32, {1, 2, 3}));
  const std::vector<kvsnap::Array> delta(states,
                                         kvsnap::Array::zeros(kvsnap::DType::f32, {1, 1, 2, 2}));
  recurrent.put(batch, conv, delta);
}

void write_seeds(const std::string& dir) {
  {
    kvsnap::PrefixCache prefix({&attention, &recurrent, nullptr});
    for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{5, 6, 7, 8}, {5, 6, 9}}) {
      auto session = prefix.begin(prompt);
      forward(static_cast<int64_t>(session.remaining().size()));
      session.prefill_done();
    }
    prefix.save(dir, "fuzz");
  }
  kvsnap::SnapshotPtr a = attention.snapshot(1), r = recurrent.snapshot(0);
  std::ofstream(dir + "/snapshots.safetensors", std::ios::binary) << kvsnap::encode_snapshots(
      attention.offset(), std::vector<const kvsnap::Snapshot*>{a.get(), r.get(), nullptr});
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("KVSNAP_FUZZ_SEED")) {
    write_seeds(seed);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    (void)kvsnap::decode_snapshots(bytes, "fuzz");
  } catch (const kvsnap::Error&) {
  }
  try {
    (void)kvsnap::detail::decode_trie(bytes, "fuzz", fuzz_layers(), "fuzz");
  } catch (const kvsnap::Error&) {
  }
  // As a load under a small budget reads it: the node table over outlines, the eviction planned,
  // only the kept nodes' data read, the doomed nodes removed from the built trie.
  for (const int64_t budget : {int64_t{0}, int64_t{200}}) {
    try {
      (void)kvsnap::detail::build_trie(
          fuzz_layers(), kvsnap::detail::read_trie(
                             [&](const kvsnap::detail::TensorFilter& keep) {
                               return kvsnap::detail::read_sealed(bytes, "fuzz", keep);
                             },
                             "fuzz", fuzz_layers(), "fuzz", {}, budget));
    } catch (const kvsnap::Error&) {
    }
  }
  return 0;
}

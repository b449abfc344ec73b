// libFuzzer target for the snapshot file loader: any input must either load or be rejected
// with kvsnap::Error — never crash, hang, leak or throw anything else.
//
// With KVSNAP_FUZZ_SEED=path set, writes a valid file there (the seed corpus) and exits.
#include <kvsnap/kvsnap.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* seed = std::getenv("KVSNAP_FUZZ_SEED")) {
    kvsnap::KVCache attention;
    kvsnap::RecurrentCache recurrent(2, 3, 1, 2, 2);
    const std::vector<float> values(1 * 2 * 3 * 2, 0.5f);
    (void)attention.update(kvsnap::Batch::uniform(1, 3, 0),
                           kvsnap::Array::from_floats(values, {1, 2, 3, 2}, kvsnap::DType::f16),
                           kvsnap::Array::from_floats(values, {1, 2, 3, 2}, kvsnap::DType::f16));
    const auto batch = kvsnap::Batch::uniform(1, 3, 0);
    (void)recurrent.get(batch, kvsnap::DType::f32);
    const std::vector<kvsnap::Array> conv{kvsnap::Array::zeros(kvsnap::DType::f32, {1, 2, 3})};
    const std::vector<kvsnap::Array> delta{kvsnap::Array::zeros(kvsnap::DType::f32, {1, 1, 2, 2})};
    recurrent.put(batch, conv, delta);
    kvsnap::SnapshotPtr a = attention.snapshot(1), r = recurrent.snapshot(0);
    std::ofstream(seed, std::ios::binary) << kvsnap::encode_snapshots(
        3, std::vector<const kvsnap::Snapshot*>{a.get(), nullptr, r.get()});
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)kvsnap::decode_snapshots(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const kvsnap::Error&) {
  }
  return 0;
}

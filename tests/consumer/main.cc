// A program outside the kvsnap tree, built against the installed headers and shared library:
// every public header compiles (the umbrella includes them all) and each layer links.
#include <kvsnap/kvsnap.h>

#include <cstdio>
#include <vector>

int main() {
  using namespace kvsnap;
  const std::vector<float> values{1, 2, 3, 4, 5, 6};
  const auto a = Array::from_floats(values, {2, 3}, DType::bf16);
  const auto column = a.slice(1, 1, 2).to_floats();
  bool ok = column.size() == 2 && column[0] == 2.0f && column[1] == 5.0f;

  KVCache attention;
  RotatingKVCache window(4);
  RecurrentCache recurrent(2, 4, 1, 2, 2);
  PrefixCache prefix({&attention, &window, &recurrent});
  const std::vector<int32_t> prompt{1, 2, 3};
  auto session = prefix.begin(prompt);
  const Batch batch = Batch::single(session.remaining(), 0);
  const Array kv = Array::zeros(DType::f32, {1, 1, 3, 2});
  const KVHistory history = attention.update(batch, kv, kv);
  (void)window.update(batch, kv, kv);
  const Array q = Array::zeros(DType::f32, {1, 1, 3, 2});
  ok = ok && sdpa(batch, q, history, AttentionMask::causal(), 1.0f).dim(2) == 3;
  (void)recurrent.get(batch, DType::f32);
  const Array conv = Array::zeros(DType::f32, {1, 2, 4});
  const Array delta = Array::zeros(DType::f32, {1, 1, 2, 2});
  const auto splits = recurrent.snapshot_splits(3);
  std::vector<Array> convs(splits.size() + 1, conv), deltas(splits.size() + 1, delta);
  recurrent.put(batch, convs, deltas);
  session.prefill_done();
  session.close();
  ok = ok && prefix.begin(prompt).cached() == 2;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong");
  return ok ? 0 : 1;
}

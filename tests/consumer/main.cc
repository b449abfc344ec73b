#include <kvsnap/kvsnap.h>

#include <cstdio>
#include <vector>

int main() {
  const std::vector<float> values{1, 2, 3, 4, 5, 6};
  const auto a = kvsnap::Array::from_floats(values, {2, 3}, kvsnap::DType::bf16);
  const auto column = a.slice(1, 1, 2).to_floats();
  const bool ok = column.size() == 2 && column[0] == 2.0f && column[1] == 5.0f;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong");
  return ok ? 0 : 1;
}

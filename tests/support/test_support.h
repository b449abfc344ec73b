// Shared helpers for kvsnap tests: deterministic random arrays and tolerant comparisons.
#pragma once

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

namespace kvsnap::testing {

inline int64_t element_count(const Shape& shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

// Normally distributed values, deterministic for a given generator state.
inline std::vector<float> random_floats(size_t count, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& value : values) value = normal(rng);
  return values;
}

inline std::vector<float> uniform_floats(size_t count, std::mt19937& rng, float low, float high) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<float> values(count);
  for (float& value : values) value = uniform(rng);
  return values;
}

inline Array random_array(Shape shape, std::mt19937& rng, DType dtype = DType::f32) {
  const auto values = random_floats(static_cast<size_t>(element_count(shape)), rng);
  return Array::from_floats(values, std::move(shape), dtype);
}

// Expects equal shapes and |a - b| <= tolerance * max(1, |b|) elementwise.
inline ::testing::AssertionResult all_close(const Array& actual, const Array& expected,
                                            float tolerance = 1e-5f) {
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.describe() << " vs " << expected.describe();
  }
  const auto a = actual.to_floats();
  const auto b = expected.to_floats();
  for (size_t i = 0; i < a.size(); ++i) {
    const float limit = tolerance * std::max(1.0f, std::fabs(b[i]));
    if (!(std::fabs(a[i] - b[i]) <= limit)) {
      return ::testing::AssertionFailure()
             << "element " << i << ": " << a[i] << " vs " << b[i] << " (tolerance " << limit << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs `call` and expects a kvsnap::Error whose message contains every fragment.
template <class Call>
::testing::AssertionResult throws_error(Call&& call, std::initializer_list<const char*> fragments) {
  try {
    call();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const char* fragment : fragments) {
      if (message.find(fragment) == std::string::npos) {
        return ::testing::AssertionFailure()
               << "message \"" << message << "\" lacks \"" << fragment << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& other) {
    return ::testing::AssertionFailure() << "threw a non-kvsnap exception: " << other.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// Runs `one(seed)` for seeds 1..runs — KVSNAP_SOAK_SEEDS, when set, for a longer soak run —
// checking after each that it failed nothing and leaked no array bytes, and stopping at the
// first seed that did. Returns the number of seeds asked for (for coverage thresholds).
template <class One>
int for_each_seed(int runs, One&& one) {
  if (const char* soak = std::getenv("KVSNAP_SOAK_SEEDS")) runs = std::atoi(soak);
  const int64_t baseline = live_bytes();
  for (int seed = 1; seed <= runs; ++seed) {
    one(static_cast<uint32_t>(seed));
    EXPECT_FALSE(::testing::Test::HasFailure()) << "seed " << seed;
    EXPECT_EQ(live_bytes(), baseline) << "seed " << seed << " leaked array bytes";
    if (::testing::Test::HasFailure()) break;
  }
  return runs;
}

}  // namespace kvsnap::testing

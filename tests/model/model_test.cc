#include "model/model.h"

#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>

#include "persist/files.h"
#include "persist/safetensors.h"
#include "support/private_support.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::all_close;
using testing::throws_error;

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden = 32;
  c.mlp_hidden = 48;
  c.query_heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.window = 6;
  c.pattern = "RSAR";
  c.delta_key_heads = 1;
  c.delta_value_heads = 2;
  c.delta_head_dim = 8;
  return c;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t length, int64_t vocab) {
  std::vector<int32_t> out(static_cast<size_t>(length));
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % vocab);
  return out;
}

// Logits for every position, evaluated in the given chunk lengths.
Array run_chunked(const Model& model, const std::vector<int32_t>& prompt,
                  const std::vector<int64_t>& chunks) {
  auto caches = model.make_caches();
  const auto pointers = cache_pointers(caches);
  Array all =
      Array::zeros(DType::f32, {static_cast<int64_t>(prompt.size()), model.config().vocab_size});
  int64_t start = 0;
  for (int64_t length : chunks) {
    const std::span<const int32_t> part(prompt.data() + start, static_cast<size_t>(length));
    all.slice(0, start, start + length).assign(model.forward(part, pointers, true));
    start += length;
  }
  return all;
}

TEST(Model, CachedForwardEqualsOneForwardForRandomChunkings) {
  const Model model(small_config());
  std::mt19937 rng(3);
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t length = 1 + static_cast<int64_t>(rng() % 40);
    const auto prompt = random_prompt(rng, length, 64);
    const Array whole = run_chunked(model, prompt, {length});
    std::vector<int64_t> chunks;
    for (int64_t left = length; left > 0;) {
      const int64_t n =
          std::min<int64_t>(left, rng() % 3 == 0 ? 1 : 1 + static_cast<int64_t>(rng() % 9));
      chunks.push_back(n);
      left -= n;
    }
    EXPECT_TRUE(all_close(run_chunked(model, prompt, chunks), whole, 1e-4f)) << "trial " << trial;
  }
}

TEST(Model, PrefixCacheReuseEqualsRecomputation) {
  const Model model(small_config());
  auto caches = model.make_caches();
  PrefixCache prefix(cache_pointers(caches));
  std::mt19937 rng(5);
  const auto system = random_prompt(rng, 20, 64);
  for (int conversation = 0; conversation < 4; ++conversation) {
    auto prompt = system;
    const auto user = random_prompt(rng, 5 + conversation, 64);
    prompt.insert(prompt.end(), user.begin(), user.end());
    auto session = prefix.begin(prompt);
    if (conversation > 1) {
      EXPECT_EQ(session.cached(), 20);  // the system prompt's restore point
    }
    const std::vector<int64_t> boundary{20};
    if (session.cached() <= 20) session.schedule_snapshots(boundary);
    const Array got = model.forward(session.remaining(), cache_pointers(caches));
    session.prefill_done();
    session.close();
    auto fresh = model.make_caches();
    const Array expected = model.forward(prompt, cache_pointers(fresh));
    EXPECT_TRUE(all_close(got, expected, 1e-4f)) << conversation;
  }
  EXPECT_GE(prefix.stats().reused_tokens, 3 * 20);
}

TEST(Model, SameSeedSameWeightsOtherSeedOtherWeights) {
  const std::vector<int32_t> prompt{1, 2, 3, 4};
  ModelConfig config = small_config();
  const Model a(config), b(config);
  config.seed = 7;
  const Model c(config);
  auto ca = a.make_caches(), cb = b.make_caches(), cc = c.make_caches();
  const Array la = a.forward(prompt, cache_pointers(ca));
  EXPECT_TRUE(all_close(la, b.forward(prompt, cache_pointers(cb)), 0.0f));
  EXPECT_FALSE(all_close(la, c.forward(prompt, cache_pointers(cc)), 1e-3f));
}

TEST(Model, SaveAndLoadRoundTripExactly) {
  const Model model(small_config());
  const auto dir = kvsnap::testing::private_scratch("kvsnap_model_test");
  std::filesystem::create_directories(dir);
  model.save((dir / "config.json").string(), (dir / "model.safetensors").string());
  const Model loaded =
      Model::load((dir / "config.json").string(), (dir / "model.safetensors").string());
  const std::vector<int32_t> prompt{5, 9, 13, 2, 2, 7};
  auto c1 = model.make_caches(), c2 = loaded.make_caches();
  EXPECT_TRUE(all_close(model.forward(prompt, cache_pointers(c1), true),
                        loaded.forward(prompt, cache_pointers(c2), true), 0.0f));
  std::filesystem::remove_all(dir);
}

// The digest keys saved state to the weights' values: equal for equal weights however they
// came (a seed, a file), other for any one value changed, a conv weight's included.
TEST(Model, WeightsDigestNamesTheWeightsValues) {
  ModelConfig config = small_config();
  const Model model(config), same(config);
  const std::string digest = model.weights_digest();
  EXPECT_EQ(digest.size(), 32U);
  EXPECT_EQ(same.weights_digest(), digest);
  config.seed = 7;
  EXPECT_NE(Model(config).weights_digest(), digest);
  const auto dir = kvsnap::testing::private_scratch("kvsnap_model_digest");
  std::filesystem::create_directories(dir);
  const std::string config_path = (dir / "config.json").string();
  const std::string weights_path = (dir / "model.safetensors").string();
  model.save(config_path, weights_path);
  EXPECT_EQ(Model::load(config_path, weights_path).weights_digest(), digest);
  for (const std::string changed : {"embed", "layers.2.wq", "layers.0.conv", "layers.3.conv"}) {
    detail::SafetensorsFile file = detail::read_safetensors(weights_path);
    file.metadata.erase("checksum");  // sealed again below, as a save of these values would
    bool found = false;
    for (auto& [name, array] : file.tensors) {
      if (name != changed) continue;
      found = true;
      std::vector<float> values = array.to_floats();
      values.back() = std::nextafter(values.back(), 1e30f);  // one ulp of one value
      array = Array::from_floats(values, array.shape());
    }
    ASSERT_TRUE(found) << changed;
    const std::string path = (dir / "changed.safetensors").string();
    { std::ofstream(path, std::ios::binary) << detail::encode_sealed(file); }
    EXPECT_NE(Model::load(config_path, path).weights_digest(), digest) << changed;
  }
  std::filesystem::remove_all(dir);
}

TEST(Model, LoadRejectsWeightsThatDisagreeWithTheConfig) {
  const Model model(small_config());
  const auto dir = kvsnap::testing::private_scratch("kvsnap_model_bad");
  std::filesystem::create_directories(dir);
  model.save((dir / "config.json").string(), (dir / "model.safetensors").string());
  // The weights name the config they were saved with: another is refused, naming what differs.
  ModelConfig wider = small_config();
  wider.hidden = 40;
  wider.window = 7;  // no tensor's shape tells this one
  { std::ofstream((dir / "wider.json").string()) << wider.to_json(); }
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Model::load((dir / "wider.json").string(), (dir / "model.safetensors").string());
      },
      {"Model::load", "saved with another config than", "wider.json", "hidden 32 (the file's: 40)",
       "window"}));
  ModelConfig reseeded = small_config();
  reseeded.seed = 99;  // loaded weights use neither
  reseeded.context_length = 1000;
  { std::ofstream((dir / "reseeded.json").string()) << reseeded.to_json(); }
  EXPECT_EQ(Model::load((dir / "reseeded.json").string(), (dir / "model.safetensors").string())
                .weights_digest(),
            model.weights_digest());
  // Files an earlier save wrote hold neither their config nor a seal: their tensors are checked
  // against the config's shapes, and a tensor no weight names is refused.
  const auto earlier = [&](const std::function<void(detail::SafetensorsFile&)>& change) {
    detail::SafetensorsFile file = detail::read_safetensors((dir / "model.safetensors").string());
    file.metadata.erase("checksum");
    file.metadata.erase("config");
    change(file);
    const std::string path = (dir / "earlier.safetensors").string();
    { std::ofstream(path, std::ios::binary) << detail::encode_safetensors(file); }
    return path;
  };
  EXPECT_TRUE(
      throws_error([&] { (void)Model::load((dir / "wider.json").string(), earlier([](auto&) {})); },
                   {"Model::load", "embed", "f32[64, 32]", "[64, 40]"}));
  ModelConfig deeper = small_config();
  deeper.pattern = "RSARA";
  { std::ofstream((dir / "deeper.json").string()) << deeper.to_json(); }
  EXPECT_TRUE(throws_error(
      [&] { (void)Model::load((dir / "deeper.json").string(), earlier([](auto&) {})); },
      {"layers.4", "missing"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)Model::load((dir / "config.json").string(), earlier([](auto& file) {
                            file.tensors.emplace_back("extra", Array::zeros(DType::f32, {2}));
                          }));
      },
      {"Model::load", "tensor \"extra\" (f32[2]) is no weight of", "config.json"}));
  // A sealed file whose bytes changed is refused whole.
  {
    std::string bytes = detail::read_file((dir / "model.safetensors").string());
    bytes[bytes.size() - 3] ^= 1;
    const std::string path = (dir / "damaged.safetensors").string();
    { std::ofstream(path, std::ios::binary) << bytes; }
    EXPECT_TRUE(throws_error([&] { (void)Model::load((dir / "config.json").string(), path); },
                             {"Model::load", "damaged.safetensors", "checksum", "does not match"}));
  }
  // Weights save did not write: no format tag, or a tensor in another dtype (converted before).
  const auto forged = [&](bool tagged, DType dtype) {
    detail::SafetensorsFile file = detail::read_safetensors((dir / "model.safetensors").string());
    file.metadata.erase("checksum");
    file.metadata.erase("config");
    if (!tagged) file.metadata.erase("format");
    for (auto& [name, array] : file.tensors) {
      if (name == "embed") array = array.astype(dtype);
    }
    const std::string path = (dir / "forged.safetensors").string();
    { std::ofstream(path, std::ios::binary) << detail::encode_safetensors(file); }
    return path;
  };
  const std::string config = (dir / "config.json").string();
  EXPECT_TRUE(throws_error([&] { (void)Model::load(config, forged(false, DType::f32)); },
                           {"metadata \"format\" is missing, not \"kvsnap-model\""}));
  EXPECT_TRUE(throws_error([&] { (void)Model::load(config, forged(true, DType::f16)); },
                           {"tensor \"embed\" is f16[64, 32]; the model's weights are f32"}));
  EXPECT_EQ(Model::load(config, forged(true, DType::f32)).config().hidden, 32);
  // A save whose weights cannot be written changes nothing (and creates no config).
  const std::string weights = (dir / "model.safetensors").string();
  const std::string before = detail::read_file(config);
  EXPECT_TRUE(
      throws_error([&] { model.save(config, (dir / "missing" / "model.safetensors").string()); },
                   {"Model::save: writing", "missing/model.safetensors"}));
  EXPECT_EQ(detail::read_file(config), before);
  const std::string fresh = (dir / "fresh.json").string();
  EXPECT_TRUE(
      throws_error([&] { model.save(fresh, (dir / "missing" / "model.safetensors").string()); },
                   {"Model::save: writing"}));
  EXPECT_FALSE(std::filesystem::exists(fresh));
  // One whose config cannot be written replaces neither file: both are written aside first.
  ModelConfig other = small_config();
  other.window = 5;
  const std::string weights_before = detail::read_file(weights);
  EXPECT_TRUE(
      throws_error([&] { Model(other).save((dir / "missing" / "config.json").string(), weights); },
                   {"Model::save: writing", "missing/config.json", "nothing replaced"}));
  EXPECT_EQ(detail::read_file(weights), weights_before);
  EXPECT_EQ(Model::load(config, weights).config().window, 6);
  // One whose config cannot take its place after the weights did (a folder there) says so, and
  // load refuses the weights with the old config, naming what differs.
  const std::string folder = (dir / "folder.json").string();
  std::filesystem::create_directory(folder);
  EXPECT_TRUE(throws_error([&] { Model(other).save(folder, weights); },
                           {"Model::save: writing", "folder.json: rename failed",
                            "load refuses them with the old config"}));
  EXPECT_TRUE(throws_error([&] { (void)Model::load(config, weights); },
                           {"saved with another config than", "window 5 (the file's: 6)"}));
  // The config and the weights under one name (also through a linked folder) would leave the
  // config alone: refused before anything is written.
  const auto alias = dir.parent_path() / (dir.filename().string() + "-alias");
  std::filesystem::create_directory_symlink(dir, alias);
  for (const std::string& same : {weights, (dir / "." / "model.safetensors").string(),
                                  (alias / "model.safetensors").string()}) {
    EXPECT_TRUE(throws_error([&] { model.save(same, weights); },
                             {"Model::save: the config", "name one file"}))
        << same;
  }
  EXPECT_TRUE(throws_error([&] { (void)Model::load(config, weights); },
                           {"saved with another config than"}));  // the weights unchanged
  std::filesystem::remove(alias);
  // No failed save left a temporary behind.
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-"), std::string::npos) << entry.path();
  }
  std::filesystem::remove_all(dir);
}

TEST(ModelConfig, FromFileReadsAConfigOfAtMostAMebibyte) {
  const auto dir = kvsnap::testing::private_scratch("kvsnap_config_file");
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  { std::ofstream(path) << R"({"hidden": 32, "window": 7})"; }
  EXPECT_EQ(ModelConfig::from_file(path).window, 7);
  EXPECT_TRUE(throws_error([&] { (void)ModelConfig::from_file((dir / "none.json").string()); },
                           {"ModelConfig::from_file", "none.json"}));
  { std::ofstream(path) << std::string((size_t(1) << 20) + 1, ' '); }
  EXPECT_TRUE(throws_error([&] { (void)ModelConfig::from_file(path); },
                           {"ModelConfig::from_file", "config.json", "more than"}));
  // What the file holds is judged naming the call and the file, too.
  { std::ofstream(path) << R"({"hidden": 32, "windows": 7})"; }
  const std::string named = "ModelConfig::from_file " + path + ": ";
  EXPECT_TRUE(
      throws_error([&] { (void)ModelConfig::from_file(path); }, {named.c_str(), "\"windows\""}));
  const std::string loading = "Model::load " + path + ": ";
  EXPECT_TRUE(throws_error([&] { (void)Model::load(path, path + ".weights"); },
                           {loading.c_str(), "\"windows\""}));
  std::filesystem::remove_all(dir);
}

// Counted by hand: per token each layer's MLP (3 x 4 x 6 multiply-adds) and projections, each
// attention token's columns, the head once.
TEST(ModelConfig, ForwardFlopsCountEveryProductAndEveryColumnSeen) {
  ModelConfig c;
  c.vocab_size = 10;
  c.hidden = 4;
  c.mlp_hidden = 6;
  c.query_heads = 2;
  c.kv_heads = 1;
  c.head_dim = 2;
  c.window = 3;
  c.pattern = "AS";
  // Projections 2 x 4 x 4 + 2 x 4 x 2; positions 4 and 5 see 5 + 6 columns in 'A' and 3 + 3 in
  // 'S', each 2 x 4 multiply-adds; the head 4 x 10.
  EXPECT_EQ(c.forward_flops(4, 2), 2.0 * (2 * 2 * (72 + 48) + 2 * 4 * (11 + 6) + 40));
  EXPECT_EQ(c.forward_flops(0, 1), 2.0 * (2 * (72 + 48) + 2 * 4 * (1 + 1) + 40));
  // Split anywhere, the same work but one more head.
  for (int64_t at = 1; at < 9; ++at) {
    EXPECT_EQ(c.forward_flops(0, at) + c.forward_flops(at, 9 - at),
              c.forward_flops(0, 9) + 2.0 * 40)
        << at;
  }
  // Past the window, a sliding-window layer's token costs the same wherever it sits.
  c.pattern = "S";
  EXPECT_EQ(c.forward_flops(3, 1), c.forward_flops(300, 1));
  EXPECT_LT(c.forward_flops(1, 1), c.forward_flops(3, 1));
  EXPECT_EQ(c.forward_flops(7, 0), 0.0);
  EXPECT_EQ(c.forward_flops(7, -1), 0.0);

  // A recurrent layer: projections to 8 conv channels (4 x 8), gate and rate (2 x 4 x 2), the
  // output (4 x 4), the conv (3 x 8) and 3 multiply-adds per state element (3 x 4 x 2).
  c.pattern = "R";
  c.delta_key_heads = 1;
  c.delta_value_heads = 2;
  c.delta_head_dim = 2;
  c.conv_kernel = 3;
  EXPECT_EQ(c.forward_flops(0, 1), 2.0 * (72 + 32 + 16 + 16 + 24 + 24 + 40));
  EXPECT_EQ(c.forward_flops(50, 3), 2.0 * (3 * (72 + 32 + 16 + 16 + 24 + 24) + 40));
}

TEST(ModelConfig, JsonRoundTripAndErrors) {
  ModelConfig config = small_config();
  config.rope_theta = 500.0f;
  config.context_length = 1000;
  const ModelConfig back = ModelConfig::from_json(config.to_json());
  EXPECT_EQ(back.context_length, 1000);
  EXPECT_EQ(back.to_json(), config.to_json());
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"hiden\": 3}"); },
                           {"unknown field \"hiden\""}));
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"pattern\": \"AXR\"}"); },
                           {"pattern \"AXR\""}));
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"query_heads\": 3}"); },
                           {"query_heads = 3", "multiple of kv_heads"}));
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"context_length\": 0}"); },
                           {"context_length = 0", "need 1 <= context_length"}));
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"hidden\": \"big\"}"); },
                           {"\"hidden\"", "must be an integer"}));
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("[1, 2"); }, {"not valid JSON"}));
  // A field given twice is refused (JSON's parse would keep the second silently), as is a
  // pattern of more layers than a model holds, naming the field.
  EXPECT_TRUE(
      throws_error([] { (void)ModelConfig::from_json("{\"hidden\": 64, \"hidden\": 4096}"); },
                   {"ModelConfig: field \"hidden\" is given twice"}));
  EXPECT_TRUE(throws_error(
      [] {
        (void)ModelConfig::from_json("{\"pattern\": \"" + std::string((1 << 20) + 1, 'A') + "\"}");
      },
      {"ModelConfig: pattern's layers = 1048577"}));
  // Sizes are whole numbers (not truncated, and 1e300 is not an undefined conversion), floats
  // finite (1e39 is infinity as a float), the seed non-negative.
  for (const char* text : {"{\"context_length\": 4096.9}", "{\"hidden\": 1e300}"}) {
    EXPECT_TRUE(throws_error([&] { (void)ModelConfig::from_json(text); }, {"must be an integer"}))
        << text;
  }
  for (const char* text : {"{\"rms_eps\": 1e39}", "{\"rms_eps\": true}"}) {
    EXPECT_TRUE(throws_error([&] { (void)ModelConfig::from_json(text); },
                             {"\"rms_eps\" must be a finite number"}))
        << text;
  }
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json("{\"seed\": -1}"); },
                           {"\"seed\" must be an integer >= 0"}));
  // Sizes whose products overflowed (q = query_heads * head_dim wrapped to 0): each is at most
  // 2^20, and the parameters at most 2^40.
  EXPECT_TRUE(throws_error(
      [] {
        (void)ModelConfig::from_json(
            R"({"query_heads": 4294967296, "kv_heads": 4294967296, "head_dim": 4294967296})");
      },
      {"query_heads = 4294967296", "need <= 2^20"}));
  EXPECT_TRUE(throws_error(
      [] { (void)ModelConfig::from_json(R"({"hidden": 1048576, "mlp_hidden": 1048576})"); },
      {"more than 2^40 parameters"}));
  EXPECT_TRUE(
      throws_error([] { (void)ModelConfig::from_json(R"({"context_length": 4294967296})"); },
                   {"context_length = 4294967296", "2^24"}));
  // 18M parameters, but a 16 GiB delta state per sequence: refused for what it would hold.
  EXPECT_TRUE(throws_error(
      [] {
        (void)ModelConfig::from_json(
            R"({"hidden": 64, "mlp_hidden": 64, "pattern": "R", "delta_key_heads": 1,
                "delta_value_heads": 1, "delta_head_dim": 65536})");
      },
      {"a recurrent layer's state of 4294967296 floats per sequence (at most 2^28)"}));
  // No recurrent layer: the delta sizes describe nothing held.
  EXPECT_EQ(ModelConfig::from_json(R"({"pattern": "AS", "delta_head_dim": 65536})").pattern, "AS");
  EXPECT_TRUE(throws_error([] { (void)ModelConfig::from_json(R"({"rope_theta": 1e-30})"); },
                           {"rope_theta 1e-30 must be finite and >= 1"}));
  // Set in code (JSON holds no infinity): refused too. An infinite rms_eps zeroed every
  // activation, and to_json wrote it as null.
  for (const bool eps : {true, false}) {
    ModelConfig config = small_config();
    (eps ? config.rms_eps : config.rope_theta) = std::numeric_limits<float>::infinity();
    EXPECT_TRUE(throws_error([&] { config.validate(); }, {"must be finite"}));
    EXPECT_TRUE(throws_error([&] { const Model model(config); }, {"must be finite"}));
  }
}

// Caches that do not fit the layers are refused before any layer moves: one cache for two
// layers, another kind, a recurrent state of other sizes, a window of another size.
TEST(Model, ForwardRefusesCachesThatDoNotFitTheLayers) {
  const Model model(small_config());  // RSAR, window 6
  const std::vector<int32_t> ok{1, 2};
  const auto refused = [&](std::vector<Cache*> layers, const char* text) {
    const std::vector<int64_t> before = [&] {
      std::vector<int64_t> offsets;
      for (Cache* c : layers) offsets.push_back(c->offset());
      return offsets;
    }();
    EXPECT_TRUE(throws_error([&] { (void)model.forward(ok, layers); }, {text})) << text;
    for (size_t i = 0; i < layers.size(); ++i) EXPECT_EQ(layers[i]->offset(), before[i]);
  };
  auto caches = model.make_caches();
  std::vector<Cache*> layers = cache_pointers(caches);
  refused({layers[0], layers[1], layers[2], layers[0]},
          "layers 0 and 3 are given one cache; each layer holds its own state");
  RecurrentCache other_sizes(3, 40, 2, 8, 8);
  refused({&other_sizes, layers[1], layers[2], layers[3]}, "layer 0 needs a RecurrentCache of");
  RotatingKVCache wider(7);
  refused({layers[0], &wider, layers[2], layers[3]},
          "layer 1 needs a RotatingKVCache of the model's window, 6 tokens");
  RotatingKVCache window(6);
  refused({layers[0], layers[1], &window, layers[3]}, "layer 2 needs a full-attention cache");
  // A recurrent sequence whose state another dtype fixed (a get, or a restore of its snapshot).
  auto half = model.make_caches();
  (void)dynamic_cast<RecurrentCache&>(*half[3]).get(Batch::uniform(1, 1, 0), DType::f16);
  refused({layers[0], layers[1], layers[2], half[3].get()},
          "layer 3 needs f32 state: sequence 0 holds f16 state (fixed until reset)");
  half[3]->reset(0);
  EXPECT_EQ(dynamic_cast<RecurrentCache&>(*half[3]).state_dtype(0), std::nullopt);
  (void)model.forward(ok, layers);  // the model's own caches serve
}

TEST(Model, ForwardRejectsBadInput) {
  const Model model(small_config());
  auto caches = model.make_caches();
  const std::vector<int32_t> bad{1, 64};
  EXPECT_TRUE(throws_error([&] { (void)model.forward(bad, cache_pointers(caches)); },
                           {"token 64", "[0, 64)"}));
  EXPECT_TRUE(throws_error(
      [&] { (void)model.forward(std::vector<int32_t>{}, cache_pointers(caches)); }, {"no tokens"}));
  const std::vector<int32_t> ok{1, 2};
  (void)model.forward(ok, cache_pointers(caches));
  caches[2]->reset();
  EXPECT_TRUE(throws_error([&] { (void)model.forward(ok, cache_pointers(caches)); },
                           {"layer 2", "offset 0", "offset 2"}));
}

// Random continuous batching: every step takes a random set of the sequences, each a chunk of
// random length (often one token, as a decode), and evaluates them in one forward. Every
// sequence's logits must equal evaluating it alone in one forward — and, with `bitwise`,
// bitwise equal evaluating it alone in the same chunks: the projections are batch-invariant
// and attention and the recurrent kernels run row by row over contiguous caches.
void check_batched_equals_alone(const Model::CacheOptions& options, uint32_t seed,
                                bool bitwise = false) {
  const Model model(small_config());
  std::mt19937 rng(seed);
  for (int trial = 0; trial < 6; ++trial) {
    const int sequences = 2 + static_cast<int>(rng() % 3);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<Array> logits;
    for (int s = 0; s < sequences; ++s) {
      prompts.push_back(random_prompt(rng, 1 + static_cast<int64_t>(rng() % 30), 64));
      logits.push_back(Array::zeros(
          DType::f32, {static_cast<int64_t>(prompts.back().size()), model.config().vocab_size}));
    }
    auto caches = model.make_caches(options);
    const auto pointers = cache_pointers(caches);
    std::vector<int64_t> done(static_cast<size_t>(sequences), 0);
    std::vector<std::vector<int64_t>> lengths(static_cast<size_t>(sequences));
    const auto remaining = [&](int s) {
      return static_cast<int64_t>(prompts[static_cast<size_t>(s)].size()) -
             done[static_cast<size_t>(s)];
    };
    for (bool more = true; more;) {
      std::vector<Model::Chunk> chunks;
      std::vector<int> chosen;
      for (int s = 0; s < sequences; ++s) {
        if (remaining(s) == 0 || rng() % 3 == 0) continue;
        const int64_t length = rng() % 2 == 0 ? 1 : 1 + static_cast<int64_t>(rng() % remaining(s));
        chunks.push_back({static_cast<int32_t>(2 * s + 1),  // sparse sequence ids
                          std::span<const int32_t>(prompts[static_cast<size_t>(s)])
                              .subspan(static_cast<size_t>(done[static_cast<size_t>(s)]),
                                       static_cast<size_t>(length))});
        chosen.push_back(s);
      }
      if (chunks.empty()) continue;
      const Array out = model.forward(chunks, pointers, /*all_positions=*/true);
      int64_t row = 0;
      for (size_t i = 0; i < chunks.size(); ++i) {
        const auto s = static_cast<size_t>(chosen[i]);
        const auto length = static_cast<int64_t>(chunks[i].tokens.size());
        logits[s].slice(0, done[s], done[s] + length).assign(out.slice(0, row, row + length));
        row += length;
        done[s] += length;
        lengths[s].push_back(length);
      }
      EXPECT_EQ(row, out.dim(0));
      more = false;
      for (int s = 0; s < sequences; ++s) more = more || remaining(s) > 0;
    }
    for (int s = 0; s < sequences; ++s) {
      const auto& prompt = prompts[static_cast<size_t>(s)];
      EXPECT_TRUE(all_close(logits[static_cast<size_t>(s)],
                            run_chunked(model, prompt, {static_cast<int64_t>(prompt.size())}),
                            1e-4))
          << "trial " << trial << " sequence " << s;
      for (Cache* cache : pointers) EXPECT_EQ(cache->offset(2 * s + 1), prompt.size());
      if (!bitwise) continue;
      const Array alone = run_chunked(model, prompt, lengths[static_cast<size_t>(s)]);
      const std::vector<float> a = logits[static_cast<size_t>(s)].to_floats(),
                               b = alone.to_floats();
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << "trial " << trial << " sequence " << s
          << ": batched logits differ from the same chunks evaluated alone";
    }
  }
}

TEST(Model, BatchedForwardEqualsEachSequenceAloneBitwise) {
  check_batched_equals_alone({}, 21, /*bitwise=*/true);
}

TEST(Model, BatchedForwardOverPagedCachesEqualsEachSequenceAlone) {
  check_batched_equals_alone({.paged = true, .block_tokens = 4}, 22);
}

TEST(Model, BatchedForwardLastTokenLogitsComeInChunkOrder) {
  const Model model(small_config());
  std::mt19937 rng(5);
  const auto a = random_prompt(rng, 9, 64), b = random_prompt(rng, 1, 64),
             c = random_prompt(rng, 9, 64);
  auto caches = model.make_caches();
  const std::vector<Model::Chunk> chunks{{4, a}, {0, b}, {7, c}};
  const Array out = model.forward(chunks, cache_pointers(caches));
  ASSERT_EQ(out.shape(), (Shape{3, 64}));
  int64_t row = 0;
  for (const auto* prompt : {&a, &b, &c}) {
    const Array alone = run_chunked(model, *prompt, {static_cast<int64_t>(prompt->size())});
    const auto last = static_cast<int64_t>(prompt->size()) - 1;
    EXPECT_TRUE(all_close(out.slice(0, row, row + 1), alone.slice(0, last, last + 1), 1e-4));
    ++row;
  }
}

// A capture scheduled in one row of a batch lands at its offset: the recurrent layers split
// that row's kernels there, and restoring the capture elsewhere continues exactly.
TEST(Model, BatchedForwardCapturesAtEachRowsScheduledOffset) {
  const Model model(small_config());
  std::mt19937 rng(6);
  const auto a = random_prompt(rng, 12, 64), b = random_prompt(rng, 12, 64);
  auto caches = model.make_caches();
  const auto pointers = cache_pointers(caches);
  const std::vector<int64_t> at{5};
  for (Cache* cache : pointers) cache->prepare_snapshots(/*seq=*/1, at);
  const std::vector<Model::Chunk> chunks{{0, a}, {1, b}};
  (void)model.forward(chunks, pointers);
  std::vector<SnapshotPtr> captured;
  for (Cache* cache : pointers) {
    auto taken = cache->take_snapshots(1);
    ASSERT_EQ(taken.size(), 1u);
    captured.push_back(std::move(taken.front()));
    EXPECT_TRUE(cache->take_snapshots(0).empty());
  }
  auto fresh = model.make_caches();
  const auto fresh_pointers = cache_pointers(fresh);
  for (size_t i = 0; i < fresh_pointers.size(); ++i) {
    ASSERT_TRUE(fresh_pointers[i]->restore(captured[i].get(), 5));
  }
  const Array rest = model.forward(std::span<const int32_t>(b).subspan(5), fresh_pointers, true);
  EXPECT_TRUE(all_close(rest, run_chunked(model, b, {12}).slice(0, 5, 12), 1e-4));
}

TEST(Model, BatchedForwardRejectsBadChunksAndChangesNothing) {
  const Model model(small_config());
  auto caches = model.make_caches();
  const auto pointers = cache_pointers(caches);
  const std::vector<int32_t> a{1, 2, 3}, b{4}, bad{70};
  (void)model.forward(std::vector<Model::Chunk>{{0, a}, {1, b}}, pointers);
  const auto unchanged = [&] {
    for (Cache* cache : pointers) {
      if (cache->offset(0) != 3 || cache->offset(1) != 1) return false;
    }
    return true;
  };
  EXPECT_TRUE(throws_error(
      [&] {
        (void)model.forward(std::vector<Model::Chunk>{{0, b}, {0, b}}, pointers);
      },
      {"Model::forward", "sequence 0"}));
  // Of two lengths (two groups of rows): refused before the first group moves any layer.
  EXPECT_TRUE(throws_error(
      [&] {
        (void)model.forward(std::vector<Model::Chunk>{{0, a}, {0, b}}, pointers);
      },
      {"Model::forward", "sequence 0 is given two chunks"}));
  EXPECT_TRUE(unchanged());
  EXPECT_TRUE(throws_error(
      [&] {
        (void)model.forward(std::vector<Model::Chunk>{{0, b}, {1, {}}}, pointers);
      },
      {"sequence 1 has no tokens"}));
  EXPECT_TRUE(throws_error(
      [&] {
        (void)model.forward(std::vector<Model::Chunk>{{0, b}, {1, bad}}, pointers);
      },
      {"token 70"}));
  EXPECT_TRUE(throws_error([&] { (void)model.forward(std::vector<Model::Chunk>{}, pointers); },
                           {"no chunks"}));
  EXPECT_TRUE(unchanged());
  caches[3]->reset(1);
  EXPECT_TRUE(throws_error(
      [&] {
        (void)model.forward(std::vector<Model::Chunk>{{0, b}, {1, b}}, pointers);
      },
      {"layer 3", "sequence 1", "offset 0", "offset 1"}));
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(pointers[i]->offset(0), 3);
}

}  // namespace
}  // namespace kvsnap

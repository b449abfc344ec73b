#include "persist/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>

#include "persist/files.h"
#include "persist/json_reading.h"

namespace kvsnap::detail {

// Bytes of the well-formed UTF-8 sequence at `text[at]` (no overlong forms, surrogates or code
// points past U+10FFFF, as JSON demands), or 0.
size_t utf8_length(std::string_view text, size_t at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  if (lead < 0x80) return 1;
  const size_t length = (lead & 0xe0) == 0xc0   ? 2
                        : (lead & 0xf0) == 0xe0 ? 3
                        : (lead & 0xf8) == 0xf0 ? 4
                                                : 0;
  if (length == 0 || at + length > text.size()) return 0;
  uint32_t code = lead & (0x7fu >> length);
  for (size_t k = 1; k < length; ++k) {
    const auto next = static_cast<unsigned char>(text[at + k]);
    if ((next & 0xc0) != 0x80) return 0;
    code = (code << 6) | (next & 0x3fu);
  }
  static constexpr uint32_t kLeast[] = {0, 0, 0x80, 0x800, 0x10000};
  const bool valid = code >= kLeast[length] && code <= 0x10ffff && (code < 0xd800 || code > 0xdfff);
  return valid ? length : 0;
}

namespace {

using Json = nlohmann::json;

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::f16:
      return "F16";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
  }
  return "?";
}

bool parse_dtype(const std::string& name, DType& dtype) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::f32}, {"F16", DType::f16}, {"BF16", DType::bf16}, {"I32", DType::i32}};
  for (const auto& [text, value] : kNames) {
    if (name == text) {
      dtype = value;
      return true;
    }
  }
  return false;
}

}  // namespace

const Array& SafetensorsFile::at(const std::string& name, const char* context) const {
  if (index.size() == tensors.size()) {
    const auto found = index.find(name);
    if (found != index.end() && found->second < tensors.size() &&
        tensors[found->second].first == name) {
      return tensors[found->second].second;
    }
    if (found == index.end())
      throw Error(fmt::format("{}: tensor \"{}\" is missing", context, name));
  }
  for (const auto& [key, array] : tensors) {
    if (key == name) return array;
  }
  throw Error(fmt::format("{}: tensor \"{}\" is missing", context, name));
}

std::string encode_safetensors(const SafetensorsFile& file, const TensorWriter& write,
                               uint64_t max_header) {
  Json header = Json::object();
  uint64_t offset = 0;
  for (const auto& [name, array] : file.tensors) {
    const auto bytes = static_cast<uint64_t>(array.nbytes());
    header[name] = {{"dtype", safetensors_dtype(array.dtype())},
                    {"shape", array.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data to 8 bytes
  if (text.size() > max_header) {
    throw HeaderTooLong(fmt::format(
        "the file's header would take {} bytes for its {} tensors, more than the {} a "
        "safetensors reader accepts: nothing was written (fewer tensors: for a prefix cache, "
        "fewer snapshots, e.g. under a smaller budget)",
        text.size(), file.tensors.size(), max_header));
  }
  std::string out(8, '\0');
  uint64_t length = text.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
  out += text;
  size_t at = out.size();
  out.resize(at + offset);
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const Array& array = file.tensors[i].second;
    if (array.size() == 0) continue;
    // Straight from the (possibly strided) view into its place: one copy of the data — unless
    // the place is not aligned for the dtype (after a 2-byte tensor of odd size; the format
    // has no padding), then through a compact copy.
    char* place = out.data() + at;
    if (reinterpret_cast<uintptr_t>(place) % static_cast<uintptr_t>(dtype_size(array.dtype())) ==
        0) {
      Array target = Array::wrap(place, array.dtype(), array.shape());
      if (!write || !write(i, target)) target.assign(array);
    } else {
      Array compact;
      if (write) {
        compact = Array::uninitialized(array.dtype(), array.shape());
        if (!write(i, compact)) compact.assign(array);
      } else {
        compact = array.is_contiguous() ? array : array.contiguous();
      }
      std::memcpy(place, compact.bytes(), static_cast<size_t>(compact.nbytes()));
    }
    at += static_cast<size_t>(array.nbytes());
  }
  return out;
}

namespace {

using Fail = std::function<Error(const std::string&)>;

// The JSON header's text in `bytes` (after its 8-byte little-endian length).
// The header of a file of `size` bytes that starts with `bytes` (at least its 8-byte length and
// the header, when the length fits the file).
std::string_view header_text(std::string_view bytes, uint64_t size, uint64_t max_header,
                             const Fail& fail) {
  if (size < 8) throw fail(fmt::format("{} bytes is shorter than the 8-byte header length", size));
  const uint64_t length = header_length(bytes);
  if (length > size - 8) {
    throw fail(
        fmt::format("header length {} exceeds the {} bytes that follow it", length, size - 8));
  }
  if (length > max_header) {
    throw fail(fmt::format("header length {} is over the {} bytes a header may have here", length,
                           max_header));
  }
  // A caller reading in parts must hand the whole header.
  if (bytes.size() < 8 || bytes.size() - 8 < length) {
    throw fail(fmt::format("internal error: {} bytes given of a {}-byte header", bytes.size() - 8,
                           length));
  }
  const std::string_view text(bytes.data() + 8, length);
  if (text.empty() || text.front() != '{') throw fail("the header does not start with '{'");
  return text;
}

// The extents of tensor `name`: each at most 2^40, and so is their product with zero extents
// counted as 1 (the strides of [0, 2^40, 2^40] overflow too); checked before it can wrap.
Shape parse_shape(const std::string& name, const Json& extents, const Fail& fail) {
  constexpr uint64_t kMaxElements = uint64_t(1) << 40;
  Shape shape;
  uint64_t product = 1;  // <= kMaxElements
  for (const Json& extent : extents) {
    if (!extent.is_number_unsigned() || extent.get<uint64_t>() > kMaxElements) {
      throw fail(
          fmt::format("tensor {} has a bad extent {}", cut_quoted(name), describe_json(extent)));
    }
    const uint64_t factor = std::max<uint64_t>(extent.get<uint64_t>(), 1);
    if (factor > kMaxElements / product) {
      throw fail(fmt::format(
          "tensor {} is too large: shape {} spans more than 2^40 elements (zero extents as 1)",
          cut_quoted(name), describe_json(extents)));
    }
    product *= factor;
    shape.push_back(static_cast<int64_t>(extent.get<uint64_t>()));
  }
  return shape;
}

// One tensor's entry: its array (data copied from `data`, `data_size` bytes; an outline when
// `data` is null) and byte range. `claimed`: the bytes the entries before it took, which this
// one's are added to.
Array parse_tensor(const std::string& name, const Json& entry, const char* data, uint64_t data_size,
                   std::pair<uint64_t, uint64_t>& range, uint64_t& claimed, const Fail& fail) {
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
      !entry.contains("data_offsets")) {
    throw fail(fmt::format("tensor {} lacks dtype, shape or data_offsets", cut_quoted(name)));
  }
  DType dtype;
  if (!entry["dtype"].is_string() || !parse_dtype(entry["dtype"].get<std::string>(), dtype)) {
    throw fail(fmt::format("tensor {} has unknown dtype {}", cut_quoted(name),
                           describe_json(entry["dtype"])));
  }
  const Json& shape_json = entry["shape"];
  if (!shape_json.is_array() || shape_json.size() > static_cast<size_t>(Array::kMaxDims)) {
    throw fail(fmt::format("tensor {} has shape {} (need at most {} extents)", cut_quoted(name),
                           describe_json(shape_json), Array::kMaxDims));
  }
  const Shape shape = parse_shape(name, shape_json, fail);
  uint64_t elements = 1;
  for (const int64_t extent : shape) elements *= static_cast<uint64_t>(extent);
  const Json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    throw fail(
        fmt::format("tensor {} has bad data_offsets {}", cut_quoted(name), describe_json(offsets)));
  }
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  const uint64_t expected = elements * static_cast<uint64_t>(dtype_size(dtype));
  if (begin > end || end > data_size || end - begin != expected) {
    throw fail(
        fmt::format("tensor {} data_offsets [{}, {}) do not hold {} bytes within the "
                    "{}-byte data section",
                    cut_quoted(name), begin, end, expected, data_size));
  }
  // The ranges must cover the data once (check_coverage), so together they hold data_size bytes:
  // more is an overlap, refused before its copy (K entries over the whole data asked for K
  // copies of it).
  if (expected > data_size - claimed) {
    throw fail(fmt::format(
        "with tensor {} (data_offsets [{}, {})) the tensors take more than the {}-byte data "
        "section: some overlap",
        cut_quoted(name), begin, end, data_size));
  }
  claimed += expected;
  range = {begin, end};
  if (data == nullptr) {
    // One element behind every index (zero strides): the shape and dtype, nothing allocated.
    alignas(16) static std::byte nothing[16]{};
    return Array::wrap(nothing, dtype, shape, Shape(shape.size(), 0));
  }
  Array array = Array::uninitialized(dtype, shape);
  if (expected > 0) std::memcpy(array.mutable_bytes(), data + begin, expected);
  return array;
}

// Throws unless the ranges cover [0, data_size) without holes or overlaps.
void check_coverage(std::vector<std::pair<uint64_t, uint64_t>> ranges, uint64_t data_size,
                    const Fail& fail) {
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) {
      throw fail(begin < covered
                     ? fmt::format("tensor data ranges overlap at byte {}", begin)
                     : fmt::format("bytes [{}, {}) of the data are not indexed", covered, begin));
    }
    covered = end;
  }
  if (covered != data_size) {
    throw fail(fmt::format("bytes [{}, {}) of the data are not indexed", covered, data_size));
  }
}

// Reads a header in one pass (nlohmann's SAX interface) without parsing it whole into values,
// which costs several times its length (a forged 100 MiB header of `{}`s took 4 GB and 20 s):
// each tensor entry is built alone, of at most kMaxEntryValues values, and read into its array
// as soon as it closes; metadata strings go straight into the file, at most kMaxMetadata.
class HeaderReader : public ValueEvents {
 public:
  // Snapshot files hold a member for each of up to 2^20 layers.
  static constexpr int64_t kMaxMetadata = (int64_t(1) << 20) + 64;
  // An entry takes 6 + Array::kMaxDims (its object, dtype, shape and extents, data_offsets and
  // its two); the rest is room for a small forgery to get the message that says what is wrong.
  static constexpr int64_t kMaxEntryValues = 64;

  HeaderReader(const char* data, uint64_t data_size, const Fail& fail, SafetensorsFile& file,
               std::vector<std::pair<uint64_t, uint64_t>>& ranges)
      : data_(data), data_size_(data_size), fail_(fail), file_(file), ranges_(ranges) {}

 private:
  bool member(std::string name) override {
    if (depth_ == 1) {
      name_ = std::move(name);
    } else if (in_metadata_ && depth_ == 2) {
      if (++metadata_ > kMaxMetadata) {
        problem_ = fmt::format("has __metadata__ of more than {} members", kMaxMetadata);
        return false;
      }
      metadata_key_ = std::move(name);
    } else {
      entry_.key(std::move(name));
    }
    return true;
  }
  bool scalar(Json value) override {
    if (in_metadata_ && depth_ == 2 && value.is_string()) {
      file_.metadata[metadata_key_] = std::move(value.get_ref<std::string&>());
      return true;
    }
    if (depth_ == 1) {  // a root member that is no object
      if (name_ == "__metadata__") throw fail_("__metadata__ is not an object");
      return finish(std::move(value));
    }
    if (in_metadata_) not_a_string();
    return added(entry_.add(std::move(value), false));
  }
  bool open(Json container) override {
    if (depth_ == 0) {  // the root (header_text saw its '{')
      depth_ = 1;
      return true;
    }
    if (depth_ == 1 && name_ == "__metadata__") {
      if (!container.is_object()) throw fail_("__metadata__ is not an object");
      in_metadata_ = true;
    } else if (depth_ == 1) {
      entry_.start(std::move(container));
    } else if (in_metadata_) {
      not_a_string();
    } else if (!added(entry_.add(std::move(container), true))) {
      return false;
    }
    ++depth_;
    return true;
  }
  bool close() override {
    if (--depth_ < 1) return true;  // the root
    if (in_metadata_) {
      in_metadata_ = depth_ != 1;
      return true;
    }
    return entry_.close() ? finish(entry_.take()) : true;
  }
  [[noreturn]] void not_a_string() const {
    throw fail_(fmt::format("metadata {} is not a string", cut_quoted(metadata_key_)));
  }
  bool added(bool within) {
    if (!within) {
      problem_ = fmt::format("has tensor {} of more than {} JSON values", cut_quoted(name_),
                             kMaxEntryValues);
    }
    return within;
  }
  bool finish(const Json& entry) {
    std::pair<uint64_t, uint64_t> range;
    file_.tensors.emplace_back(
        name_, parse_tensor(name_, entry, data_, data_size_, range, claimed_, fail_));
    ranges_.push_back(range);
    return true;
  }

  const char* data_;
  uint64_t data_size_;
  const Fail& fail_;
  SafetensorsFile& file_;
  std::vector<std::pair<uint64_t, uint64_t>>& ranges_;
  std::string name_, metadata_key_;  // the root member, the metadata member being read
  ValueBuilder entry_{kMaxEntryValues};
  bool in_metadata_ = false;
  int64_t metadata_ = 0;
  uint64_t claimed_ = 0;  // data bytes the entries read so far take
};

}  // namespace

uint64_t header_length(std::string_view bytes) {
  uint64_t length = 0;
  for (size_t i = 0; i < 8 && i < bytes.size(); ++i) {
    length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  return length;
}

namespace {

// decode_safetensors over the file's first bytes (`bytes`, of a file of `size`): the data too
// when `with_data` (then `bytes` is the whole file), else the arrays are outlines.
SafetensorsFile decode(std::string_view bytes, uint64_t size, bool with_data,
                       const std::string& source, uint64_t max_header) {
  const Fail fail = [&](const std::string& rule) {
    return Error(fmt::format("safetensors {}: {}", source, rule));
  };
  const std::string_view text = header_text(bytes, size, max_header, fail);
  SafetensorsFile file;
  const uint64_t data_size = size - 8 - text.size();
  const char* data = with_data ? text.data() + text.size() : nullptr;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  HeaderReader reader(data, data_size, fail, file, ranges);
  if (!reader.run(text)) throw fail("the header " + reader.failure());
  check_coverage(ranges, data_size, fail);
  // In the order of their data.
  std::vector<size_t> order(file.tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  std::vector<std::pair<std::string, Array>> sorted;
  for (size_t i : order) sorted.push_back(std::move(file.tensors[i]));
  file.tensors = std::move(sorted);
  file.index.reserve(file.tensors.size());
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    if (!file.index.emplace(file.tensors[i].first, i).second)
      throw fail(fmt::format("tensor {} appears twice", cut_quoted(file.tensors[i].first)));
  }
  return file;
}

}  // namespace

SafetensorsFile decode_safetensors(const std::string& bytes, const std::string& source,
                                   uint64_t max_header) {
  return decode(bytes, bytes.size(), true, source, max_header);
}

SafetensorsFile decode_safetensors_header(std::string_view head, uint64_t size,
                                          const std::string& source, uint64_t max_header) {
  return decode(head, size, false, source, max_header);
}

std::string read_file(const std::string& path) {
  const FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));  // closed however it ends
  if (file.get() < 0) {
    throw Error(fmt::format("cannot open {} for reading ({})", path, std::strerror(errno)));
  }
  std::string bytes;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t count = ::read(file.get(), buffer, sizeof buffer);
    if (count < 0 && errno == EINTR) continue;
    if (count < 0) throw Error(fmt::format("error reading {} ({})", path, std::strerror(errno)));
    if (count == 0) break;
    bytes.append(buffer, static_cast<size_t>(count));
  }
  return bytes;
}

SafetensorsFile read_safetensors(const std::string& path) {
  return decode_safetensors(read_file(path), path);
}

}  // namespace kvsnap::detail

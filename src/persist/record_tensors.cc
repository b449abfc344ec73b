#include "persist/record_tensors.h"

#include <fmt/format.h>

#include <utility>

#include "kvsnap/error.h"
#include "persist/files.h"

namespace kvsnap::detail {

void RecordTensors::add(SafetensorsFile& file, std::string first, std::string second,
                        const SnapshotRecord& record, const StateSnapshot* source, int64_t column) {
  if (record.live && source == nullptr) {
    // Its arrays are not its data (views that may be overwritten, or an outline's placeholders).
    throw Error(
        fmt::format("RecordTensors::add: tensors {} / {}: a live record needs the snapshot "
                    "it came from to copy its data from",
                    first, second));
  }
  live_.resize(file.tensors.size());
  file.tensors.emplace_back(std::move(first), record.first);
  file.tensors.emplace_back(std::move(second), record.second);
  for (const bool which : {false, true}) {
    live_.push_back(source != nullptr ? std::optional(Live{source, which, column}) : std::nullopt);
  }
}

std::string RecordTensors::encode_sealed(SafetensorsFile file) const {
  const TensorWriter write = [this](size_t tensor, Array& place) {
    if (tensor >= live_.size() || !live_[tensor]) return false;
    const Live& live = *live_[tensor];
    live.source->copy_record(live.second, place, live.column);
    return true;
  };
  return detail::encode_sealed(std::move(file), write);
}

}  // namespace kvsnap::detail

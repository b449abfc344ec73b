// Internal: the folder backend of the tier — the same objects as files in one folder (written
// atomically), index sets as subfolders of empty files named by their members. Local files
// cannot time out mid-read: the deadline is checked between files. Objects do not expire.
#pragma once

#include <string>

#include "tier/store.h"

namespace kvsnap::detail {

class DirStore final : public Store {
 public:
  // Creates `folder` when missing. Throws Error when it is not a folder or cannot be created.
  explicit DirStore(std::string folder);

  void probe(std::span<const std::string> sets, std::span<const std::string> keys,
             Deadline deadline, std::vector<std::vector<std::string>>& members,
             std::vector<bool>& exists) override;
  std::vector<std::optional<std::string>> fetch(std::span<const std::string> keys,
                                                Deadline deadline) override;
  int64_t write(const WriteBatch& batch, Deadline deadline) override;

 private:
  // The file of key `key` ("kvsnap:c:..." -> "<folder>/kvsnap-c-...").
  std::string path(const std::string& key) const;

  std::string folder_;
};

}  // namespace kvsnap::detail

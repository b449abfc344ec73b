// Reply logits kept on disk for the agreement check (tools/logits.h): rows read back as written
// across the tape's write buffer, a tape lies unnamed in $TMPDIR, and a workload whose logits
// would not fit there is refused before any work.
#include "logits.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "output.h"
#include "support/private_support.h"

namespace kvsnap::tools {
namespace {

// Sets $TMPDIR for the scope of one test.
class TmpdirScope {
 public:
  explicit TmpdirScope(const std::string& folder) {
    if (const char* was = std::getenv("TMPDIR")) before_ = was;
    ::setenv("TMPDIR", folder.c_str(), 1);
  }
  ~TmpdirScope() {
    if (before_) {
      ::setenv("TMPDIR", before_->c_str(), 1);
    } else {
      ::unsetenv("TMPDIR");
    }
  }

 private:
  std::optional<std::string> before_;
};

TEST(LogitsTape, RowsReadBackAsWrittenAcrossTheWriteBuffer) {
  const auto tape = std::make_shared<LogitsTape>();
  LogitRows first(tape), second(tape);
  // 3 MB in rows of 3000 floats: the buffer (1 MiB) is written out several times, and the last
  // rows are read while still in it.
  for (int i = 0; i < 250; ++i) {
    std::vector<float> row(3000);
    for (size_t k = 0; k < row.size(); ++k) row[k] = static_cast<float>(i * 7919 + k);
    (i % 2 == 0 ? first : second).push_back(row);
  }
  EXPECT_EQ(first.size(), 125U);
  EXPECT_EQ(tape->bytes(), int64_t{250} * 3000 * 4);
  std::vector<float> row;
  for (size_t r = 0; r < 125; ++r) {
    for (const int parity : {0, 1}) {
      (parity == 0 ? first : second).read(r, row);
      const auto i = static_cast<int64_t>(2 * r + parity);
      ASSERT_EQ(row.size(), 3000U);
      EXPECT_EQ(row[0], static_cast<float>(i * 7919));
      EXPECT_EQ(row[2999], static_cast<float>(i * 7919 + 2999));
    }
  }
  EXPECT_EQ(LogitRows::of({{1, 2}, {3, 4}}).all(),
            (std::vector<std::vector<float>>{{1, 2}, {3, 4}}));
  EXPECT_THROW(first.push_back(std::vector<float>(5)), Error);  // rows of a request are as wide
}

// The tape is a file in $TMPDIR without a name: nothing to clean up, whatever ends the process.
TEST(LogitsTape, LivesUnnamedInTmpdir) {
  const std::filesystem::path folder = testing::private_scratch("logits_tape");
  const TmpdirScope scope(folder.string());
  EXPECT_EQ(logits_folder(), folder.string());
  LogitRows rows;  // gets a tape of its own
  rows.push_back(std::vector<float>(1000, 1.5f));
  std::vector<float> back;
  rows.read(0, back);
  EXPECT_EQ(back, std::vector<float>(1000, 1.5f));
  EXPECT_TRUE(std::filesystem::is_empty(folder));
  bool found = false;  // an open descriptor onto "<folder>/#N (deleted)" or "<name> (deleted)"
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(fd.path(), error).string();
    found = found || (target.rfind(folder.string() + "/", 0) == 0 &&
                      target.find("(deleted)") != std::string::npos);
  }
  EXPECT_TRUE(found);
  std::filesystem::remove_all(folder);
}

TEST(LogitsTape, AWorkloadWhoseLogitsDoNotFitIsRefusedUpFront) {
  const std::filesystem::path folder = testing::private_scratch("logits_room");
  const TmpdirScope scope(folder.string());
  Workload workload;
  workload.name = "big";
  for (int i = 0; i < 10000; ++i) {
    Request request;
    request.id = "r" + std::to_string(i);
    request.max_tokens = 4096;
    workload.requests.push_back(request);
  }
  // 10000 x 4096 rows of 2^20 floats, three runs: 515 TB.
  try {
    check_logits_room(workload, int64_t{1} << 20, 3);
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("replay: the agreement check keeps every reply token's logits, up to "
                           "515396075520000 bytes for 3 runs of 10000 requests in " +
                           folder.string() + ", which has "),
              std::string::npos)
        << message;
  }
  workload.requests.resize(10);
  check_logits_room(workload, 1, 3);  // 492 KB
  {
    const TmpdirScope missing("/nonexistent/kvsnap");
    EXPECT_THROW(check_logits_room(workload, 1, 3), InputError);
  }
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace kvsnap::tools

// Trusted-store mode (no MAC key): a whole, valid object that sits under another object's name —
// a KV chunk of another position or of another prompt, a restore point of another offset or of
// another prompt, copied there by whoever can write the store — is never restored. Without a MAC
// only decode_object's checks stand in the way: the key the object names must be the one it was
// fetched under, and its kind and token range those the lookup asked for. A later process rejects
// it (counted, logged with the name it was written as), restores what lies before it and no more,
// and its outputs still equal recomputation (run_turn). Over the dir: backend.
//
// The chunk and point of another prompt sit at the same position (same kind and range): the key
// check alone catches them, and without it their data would be restored. Those of another
// position or offset differ in their range too, which the range check catches behind the key
// check. A tensor count that disagrees with the layers is not reachable by copying: the layer
// configuration is part of every name's root, so the objects of other layers are never found.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "support/tier_support.h"

namespace kvsnap::tier_foreign_object_test {
namespace {

using testing::Conversation;
using testing::FolderStore;
using testing::ObjectNames;
using testing::tier_options;
using testing::TierProcess;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

std::string test_name() {
  return std::string("foreign_") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

class TierForeignObjects : public ::testing::Test {
 protected:
  // A process that runs one turn and writes what it evaluated (its writes flushed).
  void write(const Tokens& prompt, const Tokens& reply, const std::vector<int64_t>& ends) {
    TierProcess writer(store.address());
    (void)writer.turn(prompt, reply, ends);
    EXPECT_EQ(writer.tier->stats().rejected, 0);
  }
  // Copies the object named `from` over the one named `to`: both whole objects of the store.
  void copy(const std::string& from, const std::string& to) {
    const std::string bytes = store.get(from), replaced = store.get(to);
    ASSERT_FALSE(bytes.empty()) << "no object " << from;
    ASSERT_FALSE(replaced.empty()) << "no object " << to;
    ASSERT_NE(bytes, replaced);
    store.set(to, bytes);
  }
  // `reader` rejected one object, the one at `name`, as the object written as `from`; none for a
  // MAC (there is no key).
  static void expect_foreign(const TierProcess& reader, const std::string& name,
                             const std::string& from) {
    const TierStats stats = reader.tier->stats();
    EXPECT_EQ(stats.rejected, 1);
    EXPECT_EQ(stats.unauthenticated, 0);
    EXPECT_EQ(stats.hits, 1);
    EXPECT_EQ(reader.log.count("rejected " + name), 1) << reader.log.all();
    EXPECT_EQ(reader.log.count("written as " + from + ", found under another name"), 1)
        << reader.log.all();
    EXPECT_EQ(reader.log.count("trusted-store mode"), 1) << reader.log.all();
  }

  FolderStore store{test_name()};
  ObjectNames names{tier_options(), store.address()};  // of the store's objects
  Conversation talk;  // its first turn leaves points 20, 26 and 31, chunks 0, 1 and 2
  // Another first turn on the same system prompt: its chunk 2 ([16, 24)) and its points past 20
  // are its own.
  Tokens other = talk.system + tokens(700, 7);
  Tokens other_reply = tokens(750, 5);
};

// Chunk 0's object ([0, 8)) under chunk 2's name ([16, 24)): points 26 and 31 need chunk 2,
// point 20 does not. The reader deletes the object it rejected and writes chunk 2 itself, so a
// later process restores everything again.
TEST_F(TierForeignObjects, AChunkOfAnotherPositionIsRejected) {
  write(talk.first, talk.reply, talk.ends);
  const std::string chunk = names.chunk(talk.second, 2), from = names.chunk(talk.second, 0);
  copy(from, chunk);
  {
    TierProcess reader(store.address());
    EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 20);
    expect_foreign(reader, chunk, from);
  }
  EXPECT_NE(store.get(chunk), store.get(from));
  TierProcess later(store.address());
  EXPECT_EQ(later.turn(talk.second, tokens(600, 2)).cached, 37);  // all but one token
  EXPECT_EQ(later.tier->stats().rejected, 0);
}

// Chunk 2 of another prompt under this prompt's chunk 2: the same kind and range, another
// prompt's tokens [20, 24). Only the key it names tells them apart.
TEST_F(TierForeignObjects, AChunkOfAnotherPromptAtTheSamePositionIsRejected) {
  write(talk.first, talk.reply, talk.ends);
  write(other, other_reply, talk.ends);
  const std::string chunk = names.chunk(talk.second, 2), from = names.chunk(other, 2);
  copy(from, chunk);
  {
    TierProcess reader(store.address());
    EXPECT_EQ(reader.turn(talk.second, tokens(500, 3)).cached, 20);
    expect_foreign(reader, chunk, from);
  }
  TierProcess later(store.address());
  EXPECT_EQ(later.turn(talk.second, tokens(600, 2)).cached, 37);
  EXPECT_EQ(later.tier->stats().rejected, 0);
}

// Point 20's object ([16, 20) and the whole states at 20) under point 28's name ([24, 28) and
// the states at 28): as many KV tokens, another range. A prompt that leaves the turn after 28
// tokens restores point 28 when it is whole, point 20 when it is not.
TEST_F(TierForeignObjects, ARestorePointOfAnotherOffsetIsRejected) {
  const Tokens prompt = talk.system + tokens(200, 10);
  const Tokens asked = talk.system + tokens(200, 8) + tokens(900, 4);
  write(prompt, tokens(300, 2), {20, 28});
  {
    TierProcess whole(store.address());
    EXPECT_EQ(whole.tier->lookup(asked, 31).offset, 28);
  }
  const std::string point = names.point(prompt, 28), from = names.point(prompt, 20);
  copy(from, point);
  TierProcess reader(store.address());
  EXPECT_EQ(reader.turn(asked, tokens(500, 3)).cached, 20);
  expect_foreign(reader, point, from);
}

// The last restore point (26, the prompt's last token but one) of the other prompt's first turn
// under this one's: the same kind and range [24, 26), another prompt's KV data and whole states.
// A regeneration of this first turn falls back to point 20 (the system prompt's end).
TEST_F(TierForeignObjects, ARestorePointOfAnotherPromptAtTheSameOffsetIsRejected) {
  write(talk.first, talk.reply, talk.ends);
  write(other, other_reply, talk.ends);
  const std::string point = names.point(talk.first, 26), from = names.point(other, 26);
  copy(from, point);
  TierProcess reader(store.address());
  EXPECT_EQ(reader.turn(talk.first, tokens(600, 2)).cached, 20);
  expect_foreign(reader, point, from);
}

}  // namespace
}  // namespace kvsnap::tier_foreign_object_test

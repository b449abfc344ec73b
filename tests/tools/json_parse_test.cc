#include "json_parse.h"

#include <gtest/gtest.h>
#include <kvsnap/error.h>

#include <chrono>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace kvsnap::tools {
namespace {

using kvsnap::testing::throws_error;

// Texts nlohmann::json::parse accepts, each exercising one rule of the grammar.
const std::vector<std::string> kValid = {
    "{}",
    "[]",
    " \t\r\n{ \"a\" : [ 1 , 2 ] } \n",
    R"({"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})",
    R"({"a": 1, "a": 2})",  // the last duplicate wins
    R"(["\" \\ \/ \b \f \n \r \t"])",
    R"("\u0041\u00e9\u20ac\ud83d\ude00\u0000")",
    "\"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80 \x7F\"",
    "\xEF\xBB\xBF{\"bom\": true}",
    "[true, false, null]",
    "[0, -0, 1, -12, 3.25, -0.5e-3, 1E+2, 18446744073709551615, 18446744073709551616]",
    "9223372036854775807",
    "[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]",
    "\"\"",
};

// Texts nlohmann::json::parse refuses.
const std::vector<std::string> kInvalid = {
    "",
    "   ",
    "{",
    "{\"a\" 1}",
    "{\"a\": 1,}",
    "{1: 2}",
    "[1,]",
    "[1 2]",
    "01",
    "1.",
    "-",
    ".5",
    "1e",
    "+1",
    "tru",
    "nul",
    "[]x",
    "{} {}",
    "\"unterminated",
    "\"tab\there\"",
    R"("\x")",
    R"("\u12")",
    R"("\ud800")",
    R"("\ud800\u0041")",
    R"("\udc00")",
    "\"\xC0\xAF\"",          // overlong
    "\"\xED\xA0\x80\"",      // an encoded surrogate
    "\"\xF4\x90\x80\x80\"",  // above U+10FFFF
    "\"\xE2\x82\"",          // truncated
    "\"\x80\"",              // a lone continuation byte
    "1e400",
};

TEST(ParseJson, AcceptsWhatNlohmannAcceptsWithTheSameValue) {
  for (const std::string& text : kValid) {
    EXPECT_EQ(parse_json(text), nlohmann::json::parse(text)) << text;
  }
}

TEST(ParseJson, RefusesWhatNlohmannRefusesNamingTheByte) {
  for (const std::string& text : kInvalid) {
    EXPECT_FALSE(nlohmann::json::accept(text)) << text;
    EXPECT_TRUE(throws_error([&] { (void)parse_json(text); }, {"at byte"})) << text;
  }
  EXPECT_TRUE(throws_error([] { (void)parse_json("[1, 2 x"); }, {"expected ',' or ']' at byte 7"}));
}

TEST(ParseJson, NumbersKeepNlohmannsTypes) {
  const nlohmann::json numbers = parse_json("[16, -3, 1.5, 18446744073709551615]");
  EXPECT_TRUE(numbers[0].is_number_unsigned());
  EXPECT_TRUE(numbers[1].is_number_integer());
  EXPECT_TRUE(numbers[2].is_number_float());
  EXPECT_TRUE(numbers[3].is_number_unsigned());
}

TEST(ParseJson, RefusesNestingDeeperThan64Levels) {
  EXPECT_NO_THROW((void)parse_json(std::string(65, '[') + std::string(65, ']')));
  EXPECT_TRUE(throws_error([] { (void)parse_json(std::string(100000, '[')); },
                           {"nesting deeper than 64 levels"}));
}

// The reason parse_json exists: a long message is copied in runs, not handled byte by byte.
// Measured against nlohmann in the same run (>10x in debug and optimized builds alike).
TEST(ParseJson, ALongStringParsesSeveralTimesFasterThanWithNlohmann) {
  const std::string content(5'000'000, 'a');
  const std::string text = R"({"content": ")" + content + "\\n\"}";
  const auto seconds = [](const auto& parse) {
    const auto start = std::chrono::steady_clock::now();
    const nlohmann::json json = parse();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(json["content"].template get_ref<const std::string&>().size(), 5'000'001u);
    return elapsed;
  };
  const double ours = seconds([&] { return parse_json(text); });
  const double nlohmanns = seconds([&] { return nlohmann::json::parse(text); });
  EXPECT_LT(ours * 4, nlohmanns) << ours << " s vs " << nlohmanns << " s";
}

}  // namespace
}  // namespace kvsnap::tools

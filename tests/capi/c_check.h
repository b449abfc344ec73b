/* The C tests' checks: a failed CHECK prints where and the last error, counts, and goes on; the
 * program fails at the end when any did. */
#ifndef KVSNAP_TESTS_C_CHECK_H
#define KVSNAP_TESTS_C_CHECK_H

#include <kvsnap/kvsnap_c.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

#define CHECK(condition)                                                                \
  do {                                                                                  \
    if (!(condition)) {                                                                 \
      fprintf(stderr, "%s:%d: CHECK(%s) failed (last error: %s)\n", __FILE__, __LINE__, \
              #condition, kvsnap_last_error());                                         \
      ++failures;                                                                       \
    }                                                                                   \
  } while (0)
#define CHECK_OK(call) CHECK((call) == KVSNAP_OK)
/* A failing call: its status, and the start of the message it left. */
#define CHECK_FAILS(call, status, message_start)                                    \
  do {                                                                              \
    CHECK((call) == (status));                                                      \
    CHECK(strncmp(kvsnap_last_error(), message_start, strlen(message_start)) == 0); \
  } while (0)

#endif

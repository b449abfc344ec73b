# cmake -P script: runs PROGRAM with ARGS and expects exit code EXPECT_EXIT and a clear message,
# not a crash.
#
# Optional:
#   EXPECT_OUTPUT      text that must appear somewhere in stdout or stderr
#   EXPECT_FIRST_LINE  a regular expression the first line of stderr must match
#   EXPECT_NO_STDOUT   ON: the program must print nothing on stdout (it failed before any work)
#   TIMEOUT            seconds the program may run (a refusal must be quick)

set(limit)
if(DEFINED TIMEOUT)
  set(limit TIMEOUT ${TIMEOUT})
endif()
string(TIMESTAMP started "%s")
execute_process(COMMAND ${PROGRAM} ${ARGS} ${limit} RESULT_VARIABLE status OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
string(TIMESTAMP finished "%s")
math(EXPR seconds "${finished} - ${started}")

if(NOT status STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "exit ${status} after ${seconds} s, expected ${EXPECT_EXIT}\n${out}${err}")
endif()
if(DEFINED EXPECT_OUTPUT)
  string(FIND "${out}${err}" "${EXPECT_OUTPUT}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "output lacks \"${EXPECT_OUTPUT}\":\n${out}${err}")
  endif()
endif()
if(DEFINED EXPECT_FIRST_LINE)
  string(REGEX MATCH "^[^\n]*" first_line "${err}")
  if(NOT first_line MATCHES "${EXPECT_FIRST_LINE}")
    message(FATAL_ERROR "the first line of stderr does not match \"${EXPECT_FIRST_LINE}\":\n"
                        "${first_line}\n(stderr:\n${err})")
  endif()
endif()
if(EXPECT_NO_STDOUT AND NOT out STREQUAL "")
  message(FATAL_ERROR "expected no output on stdout (a failure before any work), got:\n${out}")
endif()
message(STATUS "ok in ${seconds} s: ${err}")

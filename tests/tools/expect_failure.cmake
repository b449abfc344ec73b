# cmake -P script: runs PROGRAM with ARGS and expects exit code EXPECT_EXIT and EXPECT_OUTPUT
# somewhere in its output (a clear message, not a crash).
execute_process(COMMAND ${PROGRAM} ${ARGS} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT status EQUAL ${EXPECT_EXIT})
  message(FATAL_ERROR "exit ${status}, expected ${EXPECT_EXIT}\n${out}${err}")
endif()
string(FIND "${out}${err}" "${EXPECT_OUTPUT}" found)
if(found EQUAL -1)
  message(FATAL_ERROR "output lacks \"${EXPECT_OUTPUT}\":\n${out}${err}")
endif()
message(STATUS "ok: ${err}")

# cmake -P script: runs PROGRAM with ARGS and expects exit code EXPECT_EXIT and a clear message,
# not a crash.
#
# Optional:
#   EXPECT_OUTPUT      text that must appear somewhere in stdout or stderr
#   EXPECT_FIRST_LINE  a regular expression the first line of stderr must match
#   EXPECT_NO_STDOUT   ON: the program must print nothing on stdout (it failed before any work)
#   TIMEOUT            seconds the program may run (a refusal must be quick)
#   EXPECT_ABSENT      a path that must not exist after the run (removed before it): what a
#                      refusal before any work must not have created
#   PREPARE            one of the inputs below, written before the run and removed after it
#                      (FILE names the path, ARGS refers to it):
#     big_message      a workload whose one request has a user message of BYTES bytes
#     inherited        a workload of two requests of BYTES-byte messages, the second continuing
#                      the first ("after"): the first fits a context of 1.5 * BYTES tokens, the
#                      second cannot, whatever the first replies
#     unreadable       a file that exists but cannot be read (mode 000); when this process can
#                      read it anyway (root), the test is skipped: it prints "SKIPPED: ..." (give
#                      the test SKIP_REGULAR_EXPRESSION "SKIPPED")
#     open_key         a tier key file of 32 bytes that group and others may read (mode 0644),
#                      in a folder of mode 0700
#     private_key      a tier key file of 32 bytes, mode 0600, in a folder of mode 0700
#     dir_address_file a tier address file (mode 0600, in a folder of mode 0700) naming the
#                      dir: store "store" beside it
#     address_file     a private tier address file (mode 0600, in a folder of mode 0700) naming
#                      redis://:hunter2@host:x (a password, and a port that is not a number)
#     shared_folder    an empty folder of mode 0777 (group and others can write it)
#     foreign_folder   an empty folder of mode 0700 owned by user nobody; skipped ("SKIPPED: ...")
#                      unless this process runs as root (only root can hand a folder to another
#                      user)

# Appends a request whose user message is BYTES bytes to FILE, in 1 MB writes (one write of
# 50 MB takes cmake seconds).
function(append_request id after)
  set(fields "\"id\": \"${id}\"")
  if(after)
    string(APPEND fields ", \"after\": \"${after}\"")
  endif()
  file(APPEND ${FILE} "{${fields}, \"messages\": [{\"role\": \"user\", \"content\": \"")
  math(EXPR chunks "${BYTES} / 1000000")
  math(EXPR rest "${BYTES} % 1000000")
  string(REPEAT "a" 1000000 chunk)
  while(chunks GREATER 0)
    file(APPEND ${FILE} "${chunk}")
    math(EXPR chunks "${chunks} - 1")
  endwhile()
  string(REPEAT "a" ${rest} chunk)
  file(APPEND ${FILE} "${chunk}\"}]}\n")
endfunction()

if(PREPARE STREQUAL "big_message" OR PREPARE STREQUAL "inherited")
  file(WRITE ${FILE} "")
  append_request(big "")
  if(PREPARE STREQUAL "inherited")
    append_request(more big)
  endif()
elseif(PREPARE STREQUAL "unreadable")
  file(REMOVE ${FILE})
  file(WRITE ${FILE} "{}\n")
  execute_process(COMMAND chmod 000 ${FILE})
  execute_process(COMMAND ${CMAKE_COMMAND} -E cat ${FILE} RESULT_VARIABLE readable
                  OUTPUT_QUIET ERROR_QUIET)
  if(readable EQUAL 0)
    file(REMOVE ${FILE})
    message("SKIPPED: this process reads a file of mode 000 anyway (it runs as root), so no "
            "unreadable workload can be made here; cli_workload_read_error covers a read that "
            "fails")
    return()
  endif()
elseif(PREPARE STREQUAL "open_key")
  # In a private folder (whatever the umask): the folder is checked first, then the file.
  get_filename_component(key_folder ${FILE} DIRECTORY)
  file(MAKE_DIRECTORY ${key_folder})
  file(CHMOD ${key_folder} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
  file(WRITE ${FILE} "0123456789abcdef0123456789abcdef")
  file(CHMOD ${FILE} PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
elseif(PREPARE STREQUAL "private_key" OR PREPARE STREQUAL "dir_address_file")
  # A key (mode 0600), or an address file naming a dir: store beside it, in a private folder.
  get_filename_component(private_folder ${FILE} DIRECTORY)
  file(MAKE_DIRECTORY ${private_folder})
  file(CHMOD ${private_folder} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
  if(PREPARE STREQUAL "private_key")
    file(WRITE ${FILE} "0123456789abcdef0123456789abcdef")
  else()
    file(WRITE ${FILE} "dir:${private_folder}/store\n")
  endif()
  file(CHMOD ${FILE} PERMISSIONS OWNER_READ OWNER_WRITE)
elseif(PREPARE STREQUAL "address_file")
  get_filename_component(address_folder ${FILE} DIRECTORY)
  file(MAKE_DIRECTORY ${address_folder})
  file(CHMOD ${address_folder} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
  file(WRITE ${FILE} "redis://:hunter2@host:x\n")
  file(CHMOD ${FILE} PERMISSIONS OWNER_READ OWNER_WRITE)
elseif(PREPARE STREQUAL "shared_folder" OR PREPARE STREQUAL "foreign_folder")
  file(REMOVE_RECURSE ${FILE})
  file(MAKE_DIRECTORY ${FILE})
  if(PREPARE STREQUAL "shared_folder")
    execute_process(COMMAND chmod 0777 ${FILE} COMMAND_ERROR_IS_FATAL ANY)
  else()
    execute_process(COMMAND id -u OUTPUT_VARIABLE uid OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT uid STREQUAL "0")
      file(REMOVE_RECURSE ${FILE})
      message("SKIPPED: handing a folder to user nobody (chown) needs root; this runs as uid "
              "${uid}")
      return()
    endif()
    execute_process(COMMAND chmod 0700 ${FILE} COMMAND_ERROR_IS_FATAL ANY)
    execute_process(COMMAND chown nobody ${FILE} COMMAND_ERROR_IS_FATAL ANY)
  endif()
elseif(DEFINED PREPARE)
  message(FATAL_ERROR "PREPARE=${PREPARE}: use big_message, inherited, unreadable, "
                      "shared_folder, foreign_folder, open_key, private_key, address_file or "
                      "dir_address_file")
endif()

if(DEFINED EXPECT_ABSENT)
  file(REMOVE_RECURSE ${EXPECT_ABSENT})
endif()
set(limit)
if(DEFINED TIMEOUT)
  set(limit TIMEOUT ${TIMEOUT})
endif()
string(TIMESTAMP started "%s")
execute_process(COMMAND ${PROGRAM} ${ARGS} ${limit} RESULT_VARIABLE status OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
string(TIMESTAMP finished "%s")
math(EXPR seconds "${finished} - ${started}")
if(DEFINED PREPARE)
  file(REMOVE_RECURSE ${FILE})
endif()

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
if(DEFINED EXPECT_ABSENT AND EXISTS ${EXPECT_ABSENT})
  message(FATAL_ERROR "${EXPECT_ABSENT} exists after the run: it was created before the refusal")
endif()
if(EXPECT_NO_STDOUT AND NOT out STREQUAL "")
  message(FATAL_ERROR "expected no output on stdout (a failure before any work), got:\n${out}")
endif()
message(STATUS "ok in ${seconds} s: ${err}")

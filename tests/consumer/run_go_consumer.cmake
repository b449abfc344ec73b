# cmake -P script: install BUILD_DIR into WORK_DIR/prefix, then build and run the Go program in
# SOURCE_DIR (its own module, taking the binding from the tree) against the installed headers
# and library, as a Go user outside the tree would: cgo pointed at the prefix, nothing else.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "failed (${status}): ${ARGN}")
  endif()
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env
    "CGO_CFLAGS=-I${prefix}/include"
    "CGO_LDFLAGS=-L${prefix}/lib -Wl,-rpath,${prefix}/lib"
    "GOCACHE=${WORK_DIR}/../go/cache" "GOPATH=${WORK_DIR}/../go/path" GOFLAGS=-mod=mod
    GOPROXY=off GOENV=off
    ${GO} build -o ${WORK_DIR}/consumer .
  WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "failed (${status}): go build of the consumer in ${SOURCE_DIR}")
endif()
run(${WORK_DIR}/consumer)

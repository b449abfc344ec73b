# cmake -P script: a --cache-dir saved with --weights is keyed by the weights' content, not by
# their path. PROGRAM is kvsnap, FIXTURE the folder CliFixture.WritesAModelConfigAndTwoSetsOfWeights
# wrote (model1.json, weights1.safetensors, weights2.safetensors), WORK a scratch folder,
# WORKLOAD a workload file.
#   1. weights 1 at WORK/current.safetensors: the run saves its cache;
#   2. the same weights under another spelling of the path (WORK/./current.safetensors) load it;
#   3. weights 2 at the same path are refused (a cache saved for another model), and the saved
#      cache is left as it was.

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(COPY_FILE ${FIXTURE}/weights1.safetensors ${WORK}/current.safetensors)

function(run_kvsnap weights)
  execute_process(COMMAND ${PROGRAM} replay --quiet --chart "" --model-config ${FIXTURE}/model1.json
                          --weights ${weights} --cache-dir ${WORK}/cache ${WORKLOAD}
                  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(status ${status} PARENT_SCOPE)
  set(output "${out}${err}" PARENT_SCOPE)
endfunction()

run_kvsnap(${WORK}/current.safetensors)
if(NOT status EQUAL 0 OR NOT output MATCHES "runs agree")
  message(FATAL_ERROR "run 1: exit ${status}, expected 0 and agreeing runs:\n${output}")
endif()

run_kvsnap(${WORK}/./current.safetensors)
if(NOT status EQUAL 0 OR NOT output MATCHES "warm start: [1-9][0-9]* trie nodes loaded")
  message(FATAL_ERROR "run 2 (the same weights, another spelling of the path): exit ${status}, "
                      "expected 0 and a warm start:\n${output}")
endif()

file(SHA256 ${WORK}/cache/prefix_cache.safetensors saved)
file(COPY_FILE ${FIXTURE}/weights2.safetensors ${WORK}/current.safetensors)
run_kvsnap(${WORK}/current.safetensors)
if(NOT status EQUAL 2 OR NOT output MATCHES "it was saved for model"
   OR output MATCHES "warm start")
  message(FATAL_ERROR "run 3 (other weights at the same path): exit ${status}, expected 2 and "
                      "the saved cache refused:\n${output}")
endif()
file(SHA256 ${WORK}/cache/prefix_cache.safetensors after)
if(NOT saved STREQUAL after)
  message(FATAL_ERROR "run 3 changed the saved cache")
endif()
file(REMOVE_RECURSE ${WORK})
message(STATUS "ok")

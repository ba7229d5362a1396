# Writes git_commit.h with the commit of the source tree, at every build (not
# just at configure time, so the record follows new commits). The file is only
# rewritten when its content changes, so nothing recompiles needlessly.
# Inputs: SOURCE_DIR, OUTPUT.
set(commit "unknown")
set(dirty 0)
find_package(Git QUIET)
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} rev-parse HEAD
                  OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  # Only a bare 40-digit hash counts (a copied tree without a usable .git can
  # make git print other text and still succeed); else $MOELINK_GIT_COMMIT.
  string(LENGTH "${out}" out_len)  # CMake regexes have no {40}
  if(rc EQUAL 0 AND out MATCHES "^[0-9a-f]+$" AND out_len EQUAL 40)
    set(commit "${out}")
    execute_process(COMMAND ${GIT_EXECUTABLE} -C ${SOURCE_DIR} status --porcelain
                            --untracked-files=no
                    OUTPUT_VARIABLE st RESULT_VARIABLE rc2 ERROR_QUIET)
    if(rc2 EQUAL 0 AND NOT st STREQUAL "")
      set(dirty 1)
    endif()
  endif()
endif()
set(content "#pragma once\n#define MOELINK_BENCH_GIT_COMMIT \"${commit}\"\n#define MOELINK_BENCH_GIT_DIRTY ${dirty}\n")
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL content)
  file(WRITE "${OUTPUT}" "${content}")
endif()

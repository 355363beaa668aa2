# vsa_catch_tests(<target> <label>): registers every Catch2 test case of <target> with ctest, one ctest test each,
# named "<label>/<test case>" and labelled <label>, so that `ctest -N`, `-R`, `-L` and the summary count test cases.
#
# The cases are listed when ctest runs (<target> --list-test-names-only, by VsaCatchAddTests.cmake), not when the
# binary is built: a GPU test binary can then be built on a machine that cannot run it (CI), and where listing
# fails there is one test of the whole binary instead. Catch2 2.13's own catch_discover_tests lists at build time
# only, hence this. The binary run by hand (every case in one process) stays the quick way on a GPU machine.
set(_vsa_catch_add_tests "${CMAKE_CURRENT_LIST_DIR}/VsaCatchAddTests.cmake")

function(vsa_catch_tests target label)
  set(script "${CMAKE_CURRENT_BINARY_DIR}/${target}_cases.cmake")
  file(GENERATE OUTPUT "${script}" CONTENT "set(VSA_CATCH_EXE [==[$<TARGET_FILE:${target}>]==])
set(VSA_CATCH_TARGET [==[${target}]==])
set(VSA_CATCH_LABEL [==[${label}]==])
include([==[${_vsa_catch_add_tests}]==])
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${script}")
endfunction()

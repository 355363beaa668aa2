# Run by ctest (see VsaCatchTests.cmake) with VSA_CATCH_EXE, VSA_CATCH_TARGET and VSA_CATCH_LABEL set: one ctest
# test per Catch2 test case of the binary, or one for the whole binary where it cannot list its cases here.
execute_process(COMMAND "${VSA_CATCH_EXE}" --list-test-names-only OUTPUT_VARIABLE listed RESULT_VARIABLE status
                ERROR_QUIET)
string(REPLACE ";" "" listed "${listed}") # a CMake list separator; no case name of this project holds one
string(REPLACE "\n" ";" lines "${listed}")
set(names "")
foreach(line IN LISTS lines)
  if(NOT line MATCHES "^ *$")
    list(APPEND names "${line}")
  endif()
endforeach()
# Catch exits with the number of cases it listed; a crash or a missing runtime gives no names or no number.
if(NOT names OR NOT status MATCHES "^[0-9]+$")
  add_test("${VSA_CATCH_LABEL}/${VSA_CATCH_TARGET}" "${VSA_CATCH_EXE}")
  set_tests_properties("${VSA_CATCH_LABEL}/${VSA_CATCH_TARGET}" PROPERTIES LABELS "${VSA_CATCH_LABEL}" TIMEOUT 1500)
  return()
endif()
foreach(name IN LISTS names)
  # Commas separate patterns in a Catch test spec and brackets open tags: escaped, the spec is this one name.
  string(REGEX REPLACE "([],[])" "\\\\\\1" spec "${name}")
  # --warn NoTests: a spec that matched nothing fails rather than passing with no test run.
  add_test("${VSA_CATCH_LABEL}/${name}" "${VSA_CATCH_EXE}" "${spec}" --warn NoTests)
  set_tests_properties("${VSA_CATCH_LABEL}/${name}" PROPERTIES LABELS "${VSA_CATCH_LABEL}" TIMEOUT 600)
endforeach()

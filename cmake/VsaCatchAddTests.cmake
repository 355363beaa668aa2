# Run by ctest (see VsaCatchTests.cmake) with VSA_CATCH_EXE, VSA_CATCH_TARGET and VSA_CATCH_LABEL set: one ctest
# test per Catch2 test case of the binary, or one for the whole binary where it cannot list its cases here.

# The binary's test case names, one a list element; empty when it could not list them. Catch2 2.x lists the names
# alone with --list-test-names-only and exits with their count; 3.x dropped that option (it fails on it) and lists
# the names alone with --list-tests --verbosity quiet, exiting 0.
function(vsa_catch_names out)
  execute_process(COMMAND "${VSA_CATCH_EXE}" --list-test-names-only OUTPUT_VARIABLE listed RESULT_VARIABLE status
                  ERROR_QUIET)
  # Catch 2 exits with the number of cases it listed; a crash or a missing runtime gives no names or no number.
  if(NOT status MATCHES "^[0-9]+$" OR status EQUAL 0)
    execute_process(COMMAND "${VSA_CATCH_EXE}" --list-tests --verbosity quiet OUTPUT_VARIABLE listed
                    RESULT_VARIABLE status ERROR_QUIET)
    if(NOT status EQUAL 0)
      set(listed "")
    endif()
  endif()
  string(REPLACE ";" "" listed "${listed}") # a CMake list separator; no case name of this project holds one
  string(REPLACE "\n" ";" lines "${listed}")
  set(names "")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^ *$")
      list(APPEND names "${line}")
    endif()
  endforeach()
  set(${out} "${names}" PARENT_SCOPE)
endfunction()

vsa_catch_names(names)
if(NOT names)
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

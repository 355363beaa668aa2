# Run by ctest (see VsaCatchTests.cmake) with VSA_CATCH_EXE, VSA_CATCH_TARGET and VSA_CATCH_LABEL set: one ctest
# test per Catch2 test case of the binary, or one for the whole binary where it cannot list its cases here.

# The binary's test case names, one a list element, and the options that make a run of one name fail when the name
# matches nothing; names empty when the binary could not list them. Catch2 2.x lists the names alone with
# --list-test-names-only and exits with their count, and needs --warn NoTests to fail on a spec that matched
# nothing. Catch2 3.x fails on that option; it lists the names alone with --list-tests --verbosity quiet,
# exiting 0, and fails on a spec that matches nothing by itself (and knows no NoTests warning).
function(vsa_catch_lines text out)
  string(REPLACE ";" "" text "${text}") # a CMake list separator; no case name of this project holds one
  string(REPLACE "\n" ";" lines "${text}")
  set(names "")
  foreach(line IN LISTS lines)
    if(NOT line MATCHES "^ *$")
      list(APPEND names "${line}")
    endif()
  endforeach()
  set(${out} "${names}" PARENT_SCOPE)
endfunction()
function(vsa_catch_names out options)
  execute_process(COMMAND "${VSA_CATCH_EXE}" --list-test-names-only OUTPUT_VARIABLE listed RESULT_VARIABLE status
                  ERROR_QUIET)
  vsa_catch_lines("${listed}" names)
  list(LENGTH names count)
  # Catch 2 exits with the number of cases it listed; a crash or a missing runtime gives no names or no number.
  if(names AND status MATCHES "^[0-9]+$" AND status EQUAL count)
    set(${out} "${names}" PARENT_SCOPE)
    set(${options} --warn NoTests PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND "${VSA_CATCH_EXE}" --list-tests --verbosity quiet OUTPUT_VARIABLE listed
                  RESULT_VARIABLE status ERROR_QUIET)
  set(names "")
  if(status EQUAL 0)
    vsa_catch_lines("${listed}" names)
  endif()
  set(${out} "${names}" PARENT_SCOPE)
  set(${options} "" PARENT_SCOPE)
endfunction()

vsa_catch_names(names run_options)
if(NOT names)
  add_test("${VSA_CATCH_LABEL}/${VSA_CATCH_TARGET}" "${VSA_CATCH_EXE}")
  set_tests_properties("${VSA_CATCH_LABEL}/${VSA_CATCH_TARGET}" PROPERTIES LABELS "${VSA_CATCH_LABEL}" TIMEOUT 1500)
  return()
endif()
foreach(name IN LISTS names)
  # Commas separate patterns in a Catch test spec and brackets open tags: escaped, the spec is this one name.
  string(REGEX REPLACE "([],[])" "\\\\\\1" spec "${name}")
  # With run_options (Catch 2) or by itself (Catch 3), a spec that matched nothing fails rather than passing with no
  # test run.
  add_test("${VSA_CATCH_LABEL}/${name}" "${VSA_CATCH_EXE}" "${spec}" ${run_options})
  set_tests_properties("${VSA_CATCH_LABEL}/${name}" PROPERTIES LABELS "${VSA_CATCH_LABEL}" TIMEOUT 600)
endforeach()

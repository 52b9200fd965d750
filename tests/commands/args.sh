#!/bin/sh
# Writes each argument but the first, then the password from the environment and whether
# the server's other secrets reached it, to the file named by the first, NUL after each:
# the test reads exactly what the program got.
out=$1
shift
{ for arg in "$@"; do printf '%s\0' "$arg"; done; printf '%s\0' "${LAYERPY_BMC_PASSWORD-unset}" "${LAYERPY_TEST_PW-unset}"; } > "$out"
echo on

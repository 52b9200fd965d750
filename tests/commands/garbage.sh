#!/bin/sh
# Prints 8 MB of random bytes (binary garbage, far more than layerpy keeps) on stdout and
# 1 MB on stderr, then exits 0.
head -c 1000000 /dev/urandom >&2 &
head -c 8000000 /dev/urandom
wait

#!/bin/sh
# Marks itself running in directory $1 for a moment: the test counts commands at once.
touch "$1/$$"
sleep 0.3
rm "$1/$$"
echo on

#!/bin/sh
# A smart plug for the tests: plug.sh STATE_FILE on|off|cycle|status. Each call is
# appended to STATE_FILE.log; status prints "on" or "off".
set -eu
state=$1
echo "$2" >> "$state.log"
case $2 in
    on|off) echo "$2" > "$state" ;;
    cycle) echo on > "$state" ;;
    status) cat "$state" 2>/dev/null || echo off ;;
    *) echo "plug: unknown operation $2" >&2; exit 2 ;;
esac

#!/bin/sh
# Never ends: writes its own PID and its child's (a sleep) to $1, then waits.
sleep 3600 &
echo "$$ $!" > "$1.part" && mv "$1.part" "$1"
echo "hanging"
wait

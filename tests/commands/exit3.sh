#!/bin/sh
# Fails as a PDU that refuses does: a line on stderr, exit code 3.
echo "outlet busy: try again" >&2
echo "partial"
exit 3

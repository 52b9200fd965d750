#!/bin/bash
# Run apt-get or apt-cache for another Debian architecture (arm64) on a private state
# directory, so the host's dpkg architectures, apt sources and lists stay as they are.
#
#   minos/apt-arch.sh ARCH apt-get|apt-cache ARGS...
#
# For the host's own architecture it runs the command as it is (the host's apt). For
# another one, apt reads $LAYERPY_CACHE/apt-ARCH/sources.list (written on first use:
# Debian's mirror and security archive for this host's release, main and
# non-free-firmware; LAYERPY_DEBIAN_MIRROR and LAYERPY_DEBIAN_SECURITY override them),
# keeps its lists there, sees no installed packages, and `update` refreshes only those
# lists. The lists are fetched on first use. Example, the arm64 kernel's .deb into the
# current directory:  minos/apt-arch.sh arm64 apt-get download linux-image-arm64
set -euo pipefail
ARCH=${1:?usage: apt-arch.sh ARCH apt-get|apt-cache ARGS...}
CMD=${2:?usage: apt-arch.sh ARCH apt-get|apt-cache ARGS...}
shift 2
case "$CMD" in apt-get | apt-cache) ;; *) echo "apt-arch.sh: apt-get or apt-cache, not $CMD" >&2; exit 2 ;; esac
if [ "$ARCH" = "$(dpkg --print-architecture)" ]; then exec "$CMD" "$@"; fi
case "$ARCH" in *[!a-z0-9]* | "") echo "apt-arch.sh: bad architecture $ARCH" >&2; exit 2 ;; esac

CACHE=${LAYERPY_CACHE:-/var/cache/layerpy}
STATE=$CACHE/apt-$ARCH
MIRROR=${LAYERPY_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${LAYERPY_DEBIAN_SECURITY:-http://deb.debian.org/debian-security}
SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
mkdir -p "$STATE/lists/partial" "$STATE/archives/partial" "$STATE/empty"
SOURCES=$(
    for suite in "$SUITE" "$SUITE-updates"; do
        echo "deb [arch=$ARCH signed-by=$KEYRING] $MIRROR $suite main non-free-firmware"
    done
    echo "deb [arch=$ARCH signed-by=$KEYRING] $SECURITY $SUITE-security main non-free-firmware"
)
if [ "$(cat "$STATE/sources.list" 2>/dev/null)" != "$SOURCES" ]; then
    echo "$SOURCES" >"$STATE/sources.list"
    rm -f "$STATE"/lists/*_Packages* # other sources: fetch the lists again
fi
[ -f "$STATE/status" ] || : >"$STATE/status"
OPTS=(-o "APT::Architecture=$ARCH" -o "APT::Architectures::=$ARCH"
    -o "Dir::Etc::SourceList=$STATE/sources.list" -o "Dir::Etc::SourceParts=$STATE/empty"
    -o "Dir::Etc::Preferences=$STATE/empty/none" -o "Dir::Etc::PreferencesParts=$STATE/empty"
    -o "Dir::State=$STATE" -o "Dir::State::Lists=$STATE/lists" -o "Dir::State::status=$STATE/status"
    -o "Dir::Cache=$STATE" -o "Dir::Cache::Archives=$STATE/archives" -o "APT::Sandbox::User=root")
if ! compgen -G "$STATE/lists/*_Packages*" >/dev/null && [ "$CMD $*" != "apt-get update" ]; then
    echo "apt-arch.sh: fetching the $ARCH package lists into $STATE" >&2
    apt-get "${OPTS[@]}" update -qq >&2
fi
exec "$CMD" "${OPTS[@]}" "$@"

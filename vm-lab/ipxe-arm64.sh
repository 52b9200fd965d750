#!/usr/bin/env bash
# The lab's iPXE directory ([ipxe] dir in configs/lab.toml): Debian 12's x86 iPXE binaries
# and an arm64 one, for arm64 UEFI's PXE (arch 11) and HTTP boot (arch 19):
#
#   vm-lab/ipxe-arm64.sh      (as root; idempotent)
#
#   $LAYERPY_CACHE/ipxe/ipxe-arm64.efi  <- Debian 13's ipxe package  usr/lib/ipxe/ipxe-arm64.efi
#   $LAYERPY_CACHE/ipxe/*.kpxe, *.efi   <- copies of the host's /usr/lib/ipxe (Debian 12's ipxe)
#
# Debian 12's ipxe package is x86 only, and the source of it (or of any later ipxe) cannot be
# had from the lab's package mirror (its .orig and .debian tarballs answer 404), so nothing is
# cross-built here: Debian 13 ("trixie") builds iPXE for arm64 from its own source into the
# same architecture-independent package, and that .deb is fetched with `apt-get download`
# through a private sources list and state directory (the host's mirror, suite trixie;
# apt checks the suite's signed InRelease and the .deb's SHA256 against it), the host's apt
# sources and state left as they are. Only ipxe-arm64.efi is taken from it: the x86 binaries
# stay Debian 12's, which the rest of the lab was tested with; they are copied because [ipxe]
# has one directory and TFTP serves only what is inside it. A stamp names the .deb and the
# host's ipxe version; the same again does nothing.
set -euo pipefail
umask 022
CACHE=${LAYERPY_CACHE:-/var/cache/layerpy}
OUT=$CACHE/ipxe
DEBS=$CACHE/debs
STATE=$CACHE/apt-trixie
SUITE=trixie
HOST_IPXE=/usr/lib/ipxe
ARM64=ipxe-arm64.efi

log() { echo "ipxe-arm64: $*" >&2; }
die() { echo "ipxe-arm64: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (apt-get download)"
host=$(dpkg-query -W -f='${Version}' ipxe 2>/dev/null) || die "no ipxe package (apt-get install ipxe)"

# The host's Debian mirror, from its own apt configuration (the main archive, not security)
mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Created-By: Packages' 'Label: Debian' |
    sort -u | head -n1)
[ -n "$mirror" ] || die "no Debian mirror in the host's apt sources"

mkdir -p "$OUT" "$DEBS" "$STATE/lists/partial" "$STATE/cache/archives/partial"
echo "deb $mirror $SUITE main" >"$STATE/sources.list"
: >"$STATE/status"
apt_opts=(-o "Dir::Etc::sourcelist=$STATE/sources.list" -o "Dir::Etc::sourceparts=/nonexistent"
    -o "Dir::State=$STATE" -o "Dir::State::Lists=$STATE/lists" -o "Dir::State::status=$STATE/status"
    -o "Dir::Cache=$STATE/cache" -o APT::Sandbox::User=root)

update() { apt-get "${apt_opts[@]}" update -qq >&2 || die "apt-get update of $SUITE failed"; }
resolve() { # sets file and sha: the .deb apt's lists name (no lists yet: fetch them first)
    local uris
    uris=$(apt-get "${apt_opts[@]}" download --print-uris ipxe 2>/dev/null) || {
        update
        uris=$(apt-get "${apt_opts[@]}" download --print-uris ipxe)
    } || die "apt-get download --print-uris ipxe ($SUITE) failed"
    read -r _ file _ sha <<<"$uris"
    sha=${sha#SHA256:}
    [[ "$file" == ipxe_*_all.deb && ${#sha} = 64 ]] || die "unexpected apt-get output: $uris"
}
cached() { [ -f "$DEBS/$file" ] && [ "$(sha256sum <"$DEBS/$file" | cut -c1-64)" = "$sha" ]; }
download() { (cd "$DEBS" && apt-get "${apt_opts[@]}" download -q ipxe >&2) && cached; }

resolve
stamp="$file $sha host-ipxe=$host"
if [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$stamp" ] && [ -f "$OUT/$ARM64" ]; then
    log "up to date: $OUT ($file, host ipxe $host)"
    exit 0
fi
# lists older than the archive name a .deb it no longer has: once more with fresh lists
cached || download || { update && resolve && download; } || die "apt-get download ipxe ($SUITE) failed"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
dpkg-deb -x "$DEBS/$file" "$scratch"
[ -f "$scratch/usr/lib/ipxe/$ARM64" ] || die "no usr/lib/ipxe/$ARM64 in $file"
install -m 0644 "$scratch/usr/lib/ipxe/$ARM64" "$OUT/.$ARM64.new"
mv "$OUT/.$ARM64.new" "$OUT/$ARM64"
# the host's x86 binaries (regular files only: TFTP serves nothing that links outside)
find -L "$HOST_IPXE" -maxdepth 1 -type f \( -name '*.efi' -o -name '*.kpxe' -o -name '*.kkpxe' -o -name '*.pxe' \) \
    -exec install -m 0644 -t "$OUT" {} +
echo "$file $sha host-ipxe=$host" >"$OUT/.stamp"
log "$OUT: $ARM64 from $file ($(stat -c %s "$OUT/$ARM64") bytes), x86 binaries of ipxe $host"

#!/usr/bin/env bash
# Fetches Debian's signed shim and signed GRUB netboot image into one directory, under the
# names shim and the firmware ask for, for the Secure Boot path (docs/secure-boot.md):
#
#   vm-lab/signed-loaders.sh [amd64|arm64]...      (default: amd64; as root; idempotent)
#
#   $LAYERPY_CACHE/signed/shimx64.efi   <- shim-signed            usr/lib/shim/shimx64.efi.signed
#   $LAYERPY_CACHE/signed/grubx64.efi   <- grub-efi-amd64-signed  .../grubnetx64.efi.signed
#   $LAYERPY_CACHE/signed/shimaa64.efi  <- shim-signed:arm64      usr/lib/shim/shimaa64.efi.signed
#   $LAYERPY_CACHE/signed/grubaa64.efi  <- grub-efi-arm64-signed  .../grubnetaa64.efi.signed
#
# shim loads "grub<arch>.efi" from the directory it was loaded from, so the netboot GRUB
# is stored under that name. Nothing is installed: the .debs are fetched with
# `apt-get download` (arm64 with a private apt state directory, the host's apt left as it
# is) into $LAYERPY_CACHE/debs and unpacked with dpkg-deb. A stamp per architecture names
# the package versions; the same versions again do nothing.
set -euo pipefail
umask 022
CACHE=${LAYERPY_CACHE:-/var/cache/layerpy}
OUT=$CACHE/signed
DEBS=$CACHE/debs
mkdir -p "$OUT" "$DEBS"

log() { echo "signed-loaders: $*" >&2; }
die() { echo "signed-loaders: error: $*" >&2; exit 1; }

# apt for another architecture: the host's sources, a private state and cache directory
foreign_apt() { # ARCH -> the options for apt-get/apt-cache
    local arch=$1 state=$CACHE/apt-$1
    mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
    echo "-o APT::Architecture=$arch -o APT::Architectures=$arch -o Dir::State=$state" \
        "-o Dir::State::status=$state/status -o Dir::Cache=$state/cache"
}

fetch() { # ARCH: download the two packages, unpack the two files
    local arch=$1 opts="" shim grub suffix
    case "$arch" in
    amd64) suffix=x64 grub=grub-efi-amd64-signed grubfile=usr/lib/grub/x86_64-efi-signed/grubnetx64.efi.signed ;;
    arm64) suffix=aa64 grub=grub-efi-arm64-signed grubfile=usr/lib/grub/arm64-efi-signed/grubnetaa64.efi.signed ;;
    *) die "architecture $arch: amd64 or arm64" ;;
    esac
    shim=shim-signed
    if [ "$arch" != "$(dpkg --print-architecture)" ]; then
        opts=$(foreign_apt "$arch")
        : >"$CACHE/apt-$arch/status"
        # shellcheck disable=SC2086
        [ -n "$(ls "$CACHE/apt-$arch/lists" | grep -v -e partial -e lock)" ] ||
            apt-get $opts update -qq >&2 || die "apt-get update for $arch failed"
    fi
    local uris
    # shellcheck disable=SC2086
    uris=$(apt-get $opts download --print-uris "$shim" "$grub" 2>/dev/null) || {
        # shellcheck disable=SC2086
        apt-get $opts update -qq >&2
        # shellcheck disable=SC2086
        uris=$(apt-get $opts download --print-uris "$shim" "$grub")
    } || die "apt-get download --print-uris $shim $grub ($arch) failed"
    local list stamp=$OUT/.stamp-$arch
    list=$(echo "$uris" | awk '{ sub(/^SHA256:/, "", $4); print $2, $4 }' | sort)
    [ "$(echo "$list" | wc -l)" = 2 ] || die "unexpected apt-get output: $uris"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$list" ] &&
        [ -f "$OUT/shim$suffix.efi" ] && [ -f "$OUT/grub$suffix.efi" ]; then
        log "$arch: up to date ($(echo "$list" | awk '{ printf "%s ", $1 }'))"
        return
    fi
    local file sha
    while read -r file sha; do
        if [ ! -f "$DEBS/$file" ] || [ "$(sha256sum <"$DEBS/$file" | cut -c1-64)" != "$sha" ]; then
            # shellcheck disable=SC2086
            (cd "$DEBS" && apt-get $opts download -q -o APT::Sandbox::User=root \
                "${file%%_*}:$arch" >&2) || die "apt-get download ${file%%_*} ($arch) failed"
        fi
        [ "$(sha256sum <"$DEBS/$file" | cut -c1-64)" = "$sha" ] || die "$file: sha256 mismatch"
    done <<<"$list"
    local scratch
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' RETURN
    while read -r file _; do dpkg-deb -x "$DEBS/$file" "$scratch"; done <<<"$list"
    [ -f "$scratch/usr/lib/shim/shim$suffix.efi.signed" ] || die "no shim$suffix.efi.signed in $shim"
    [ -f "$scratch/$grubfile" ] || die "no $grubfile in $grub"
    install -m 0644 "$scratch/usr/lib/shim/shim$suffix.efi.signed" "$OUT/shim$suffix.efi.new"
    install -m 0644 "$scratch/$grubfile" "$OUT/grub$suffix.efi.new"
    mv "$OUT/shim$suffix.efi.new" "$OUT/shim$suffix.efi"
    mv "$OUT/grub$suffix.efi.new" "$OUT/grub$suffix.efi"
    echo "$list" >"$stamp"
    log "$arch: $OUT/shim$suffix.efi, $OUT/grub$suffix.efi ($(echo "$list" | awk '{ printf "%s ", $1 }'))"
}

[ "$(id -u)" = 0 ] || die "run as root (apt-get download)"
for arch in "${@:-amd64}"; do fetch "$arch"; done

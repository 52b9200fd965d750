#!/usr/bin/env bash
# Fills the Raspberry Pi firmware directory layerpy serves by TFTP ([rpi] dir, default
# /var/cache/layerpy/rpi) from Debian's own packages, idempotently:
#   raspi-firmware (non-free-firmware, arch all): start4.elf, fixup4*.dat (Pi 4 GPU firmware)
#   linux-image-*-arm64 (the one linux-image-arm64 names): the bcm2711 device trees
# apt runs on a private state directory (architecture arm64, the host's own Debian mirror and
# security archive, components main and non-free-firmware; the same kernel as the arm64
# minOS's): the host's apt sources, lists and architectures stay as they are.
# Usage: vm-lab/rpi-firmware.sh [DIR]   (as root)
set -euo pipefail

CACHE=${LAYERPY_CACHE:-/var/cache/layerpy}
DEST=${1:-$CACHE/rpi}
STATE=$CACHE/apt-arm64-rpi
SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

fail() {
  echo "rpi-firmware: $*" >&2
  echo "rpi-firmware: fill $DEST by hand with start4.elf, fixup4.dat and bcm2711-rpi-4-b.dtb" \
    "(docs/hardware.md says where each comes from)" >&2
  exit 1
}

# The host's Debian mirror and security archive: URIs of its deb822 or one-line sources.
uris=$(
  { sed -n 's/^URIs:[[:space:]]*//p' /etc/apt/sources.list.d/*.sources 2>/dev/null
    sed -nE "s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+)[[:space:]]+$SUITE[-[:space:]].*/\2/p" \
      /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null
  } | awk '{print $1}'
) || true
mirror=$(grep -v -- '-security' <<< "$uris" | head -1) || true
security=$(grep -- '-security' <<< "$uris" | head -1) || true
[ -n "$mirror" ] || fail "no Debian mirror for $SUITE in the host's apt sources"

mkdir -p "$STATE/lists/partial" "$STATE/archives/partial" "$STATE/empty" "$STATE/debs"
{
  for suite in "$SUITE" "$SUITE-updates"; do
    echo "deb [arch=arm64 signed-by=$KEYRING] $mirror $suite main non-free-firmware"
  done
  [ -z "$security" ] || echo "deb [arch=arm64 signed-by=$KEYRING] $security $SUITE-security main"
} > "$STATE/sources.list"
[ -f "$STATE/status" ] || : > "$STATE/status"
APT=(-o APT::Architecture=arm64 -o APT::Architectures::=arm64
  -o "Dir::Etc::SourceList=$STATE/sources.list" -o "Dir::Etc::SourceParts=$STATE/empty"
  -o "Dir::Etc::Preferences=$STATE/empty/none" -o "Dir::Etc::PreferencesParts=$STATE/empty"
  -o "Dir::State=$STATE" -o "Dir::State::Lists=$STATE/lists" -o "Dir::State::status=$STATE/status"
  -o "Dir::Cache=$STATE" -o "Dir::Cache::Archives=$STATE/archives" -o APT::Sandbox::User=root)

apt-get "${APT[@]}" update -qq >/dev/null 2>"$STATE/update.err" \
  || fail "apt-get update of the arm64 lists failed: $(tail -1 "$STATE/update.err")"
kernel=$(apt-cache "${APT[@]}" depends linux-image-arm64 2>/dev/null \
  | sed -n 's/^ *Depends: \(linux-image-[^ ]*-arm64\)$/\1/p' | head -1)
[ -n "$kernel" ] || fail "linux-image-arm64 names no linux-image-*-arm64 in the arm64 lists"
want="raspi-firmware=$(apt-cache "${APT[@]}" policy raspi-firmware | sed -n 's/^ *Candidate: //p') $kernel"
case "$want" in raspi-firmware=\ * | raspi-firmware=\(none\)*)
  fail "raspi-firmware is not in $mirror $SUITE non-free-firmware (arm64)" ;; esac

if [ "$(cat "$DEST/.layerpy-stamp" 2>/dev/null)" = "$want" ]; then
  echo "rpi-firmware: $DEST is up to date ($want)"
  exit 0
fi
rm -f "$STATE"/debs/*.deb
(cd "$STATE/debs" && apt-get "${APT[@]}" download -qq raspi-firmware "$kernel" 2>"$STATE/download.err") \
  || fail "apt-get download raspi-firmware $kernel failed: $(tail -1 "$STATE/download.err")"

unpacked=$STATE/unpacked
rm -rf "$unpacked" "$DEST.new"
mkdir -p "$unpacked" "$DEST.new"
for deb in "$STATE"/debs/*.deb; do
  dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$unpacked" --wildcards \
    './usr/lib/raspi-firmware/*4*' './usr/lib/linux-image-*/broadcom/bcm27*' 2>/dev/null || true
done
cp "$unpacked"/usr/lib/raspi-firmware/start4*.elf "$unpacked"/usr/lib/raspi-firmware/fixup4*.dat \
  "$DEST.new"/ 2>/dev/null || fail "raspi-firmware carries no start4.elf/fixup4.dat"
cp "$unpacked"/usr/lib/linux-image-*/broadcom/bcm27*.dtb "$DEST.new"/ 2>/dev/null \
  || fail "$kernel carries no bcm27*.dtb under /usr/lib/linux-image-*/broadcom/"
for file in start4.elf fixup4.dat bcm2711-rpi-4-b.dtb; do
  [ -s "$DEST.new/$file" ] || fail "$file missing from the unpacked packages"
done
echo "$want" > "$DEST.new/.layerpy-stamp"
rm -rf "$DEST.old" "$unpacked"
[ ! -d "$DEST" ] || mv "$DEST" "$DEST.old"
mv "$DEST.new" "$DEST"
rm -rf "$DEST.old"
echo "rpi-firmware: $DEST filled from $want ($(ls "$DEST" | wc -l) files)"

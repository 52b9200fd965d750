#!/bin/bash
# Build the layerpy minOS: a Debian kernel + a tiny initramfs (busybox-static, Debian's
# python3.11 with the stdlib trimmed to what the agent imports, the agent, and the kernel
# modules of the NICs servers have, loaded at boot for the hardware found).
#
#   minos/build.sh [--force] [--compress auto|gzip|zstd] [--flavour generic|cloud] [--arch amd64|arm64]
#
# Flavours: generic (the default, for real machines): Debian's linux-image-amd64 kernel,
# with the drivers of the common server NICs (Intel e1000e, igb, ixgbe, i40e, ice;
# Broadcom bnxt_en, tg3; Mellanox mlx5; Realtek r8169, 8139too, 8139cp; VMware vmxnet3;
# virtio);
# cloud (an explicit choice): Debian's cloud kernel, virtio only, which QEMU VMs and cloud
# instances boot faster. Outputs minos/out/ (generic) or minos/out-cloud/: vmlinuz and
# minos.cpio.{gz,zst} (plus initrd, a symlink to whichever was built, and BUILDINFO). Run
# as root on Debian 12: it only downloads .debs (apt-get download) and unpacks them
# (dpkg-deb -x); nothing is installed. See minos/README.md to add a driver or firmware.
#
# --arch arm64 builds the same minOS from Debian's arm64 packages (linux-image-arm64, the
# NICs of arm64 servers and boards) into minos/out-arm64/ (cloud: minos/out-arm64-cloud/),
# fetched by minos/apt-arch.sh on a private apt state (the host's dpkg stays amd64). The
# arm64 binaries are only copied: the stdlib trace and byte-compiling run on the host's
# python3.11, the applet list comes from the host's busybox-static of the same version,
# and the chroot check is skipped (the lab's arm64 boot test runs the agent instead).
#
# Cached: when the inputs (deb versions, minos/ files, the agent sources, options) hash to
# the stamp of the last build, it prints "up to date" and exits; when they hash to one of
# the last four builds of any checkout ($LAYERPY_CACHE/minos-out/HASH), it takes those.
# Reproducible: sorted cpio entries, mtimes from SOURCE_DATE_EPOCH, owner 0:0, gzip -n /
# zstd, hash-based .pyc.
#
# Environment: LAYERPY_CACHE (default /var/cache/layerpy: debs/, minos-build/, minos-out/),
# SOURCE_DATE_EPOCH (default 1704067200), LAYERPY_KERNEL_PKG (default: what the flavour's
# linux-image-amd64 or linux-image-cloud-amd64 depends on), LAYERPY_MINOS_MODULES (extra
# module names), LAYERPY_MINOS_FIRMWARE (extra firmware files, paths under /lib/firmware
# of the packages in LAYERPY_MINOS_FIRMWARE_DEBS).
set -euo pipefail
umask 022
export LC_ALL=C TZ=UTC

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
SRC=$REPO/src/layerpy
CACHE=${LAYERPY_CACHE:-/var/cache/layerpy}
DEBS=$CACHE/debs
WORK=$CACHE/minos-build # scratch: wiped at the start of every build
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1704067200}
mkdir -p "$CACHE"
exec 9>"$CACHE/minos-build.lock"
flock 9 # one build at a time: they share the scratch directory

PACKAGES="busybox-static python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
libc6 zlib1g libexpat1 libffi8 ${LAYERPY_MINOS_FIRMWARE_DEBS:-}"

ARGS=("$@")
FORCE=0
COMPRESS=auto
FLAVOUR=${LAYERPY_MINOS_FLAVOUR:-generic}
ARCH=amd64
while [ $# -gt 0 ]; do
    case "$1" in
    --force) FORCE=1 ;;
    --compress) COMPRESS=${2:?}; shift ;;
    --compress=*) COMPRESS=${1#*=} ;;
    --flavour) FLAVOUR=${2:?}; shift ;;
    --flavour=*) FLAVOUR=${1#*=} ;;
    --arch) ARCH=${2:?}; shift ;;
    --arch=*) ARCH=${1#*=} ;;
    -h | --help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
case "$COMPRESS" in auto | gzip | zstd) ;; *) echo "build.sh: --compress auto|gzip|zstd" >&2; exit 2 ;; esac
# Kernel modules: the NICs, what running system images needs (overlay, squashfs, loop),
# the UEFI variables (efivarfs: the agent reads SecureBoot there) and a local disk for
# persistent paths (the disk controllers, ext4). All are Debian's, signed by its kernel
# key: under Secure Boot the kernel locks itself down and loads signed modules only. Their dependencies
# come along; /init loads what the hardware found asks for.
# arm64 generic: QEMU virt (virtio PCI and MMIO), the Raspberry Pi 4 (genet, its MDIO bus and
# Broadcom PHY), the PCIe NICs of Ampere, Grace and other arm64 servers (Mellanox mlx5, Intel,
# Broadcom bnxt_en), Cavium ThunderX (nicpf, nicvf), Huawei Kunpeng (hns3), Marvell Armada
# (mvpp2), Realtek r8169 and the Cadence (macb) and Synopsys (dwmac) MACs of many SoCs; and
# the hardware RNGs of those machines (virtio, the Pi's, SMCCC TRNG firmware, ThunderX,
# X-Gene, Kunpeng): without entropy the agent's Python waits at start (~10 s under TCG).
case "$ARCH/$FLAVOUR" in
amd64/generic)
    META=linux-image-amd64 OUT=$HERE/out
    NICS="virtio_pci virtio_net e1000 e1000e igb ixgbe i40e ice bnxt_en tg3 mlx5_core r8169
    8139too 8139cp vmxnet3" DISKS="virtio_blk nvme ahci sd_mod" ;;
amd64/cloud) META=linux-image-cloud-amd64 OUT=$HERE/out-cloud NICS="virtio_pci virtio_net" DISKS=virtio_blk ;;
arm64/generic)
    META=linux-image-arm64 OUT=$HERE/out-arm64
    NICS="virtio_pci virtio_mmio virtio_net genet broadcom mlx5_core ixgbe i40e ice igb igc e1000e
    bnxt_en nicpf nicvf hns3 hclge mvpp2 r8169 macb dwmac-generic virtio_rng iproc-rng200 bcm2835-rng
    arm_smccc_trng cavium-rng-vf xgene-rng hisi-rng" DISKS="virtio_blk nvme ahci sd_mod" ;;
arm64/cloud)
    META=linux-image-cloud-arm64 OUT=$HERE/out-arm64-cloud
    NICS="virtio_pci virtio_mmio virtio_net" DISKS=virtio_blk ;;
*) echo "build.sh: --arch amd64|arm64, --flavour generic|cloud" >&2; exit 2 ;;
esac
case "$ARCH" in
amd64) TRIPLET=x86_64-linux-gnu LDSO=ld-linux-x86-64.so.2 INTERP=lib64/ld-linux-x86-64.so.2 ;;
arm64) TRIPLET=aarch64-linux-gnu LDSO=ld-linux-aarch64.so.1 INTERP=lib/ld-linux-aarch64.so.1 ;;
esac
# Another architecture's binaries do not run here: only copied, never executed.
NATIVE=0
[ "$ARCH" = "$(dpkg --print-architecture)" ] && NATIVE=1
APT=("$HERE/apt-arch.sh" "$ARCH") # the host's apt, or a private one for another architecture
MODULES=$(echo $NICS overlay squashfs loop efivarfs $DISKS ext4 ${LAYERPY_MINOS_MODULES:-})

log() { echo "minos: $*" >&2; }
die() { echo "minos: error: $*" >&2; exit 1; }
case "$CACHE" in /*) ;; *) die "LAYERPY_CACHE must be an absolute path" ;; esac
[ "$(id -u)" = 0 ] || die "run as root (device nodes, chroot check, apt-get download)"
for tool in apt-get apt-cache dpkg-deb cpio gzip depmod modprobe sha256sum chroot python3; do
    command -v "$tool" >/dev/null || die "$tool is missing"
done

size_line() { # file -> "N bytes (M MB)"
    local n
    n=$(stat -c %s "$1")
    echo "$n bytes ($(awk -v n="$n" 'BEGIN { printf "%.2f", n / 1048576 }') MB)"
}

START=$(date +%s.%N)

# --- 1. resolve package versions (local apt lists; update only if they are missing) ---
apt_retry() { # run "$@"; on failure refresh the lists once and retry
    if ! "$@" 2>/dev/null; then
        log "apt lists missing or stale; running apt-get update"
        "${APT[@]}" apt-get update -qq >&2
        "$@"
    fi
}
kernel_pkg() {
    if [ -n "${LAYERPY_KERNEL_PKG:-}" ]; then echo "$LAYERPY_KERNEL_PKG"; return; fi
    "${APT[@]}" apt-cache show --no-all-versions "$META" 2>/dev/null |
        sed -n 's/^Depends: //p' | tr ',|' '\n\n' | awk '{print $1}' |
        grep -E "^linux-image-[0-9].*-${META#linux-image-}\$" | head -n1
}
KPKG=$(kernel_pkg || true)
if [ -z "$KPKG" ]; then
    "${APT[@]}" apt-get update -qq >&2
    KPKG=$(kernel_pkg) || true
fi
[ -n "$KPKG" ] || die "cannot resolve $META to a kernel package"
# shellcheck disable=SC2086
URIS=$(apt_retry "${APT[@]}" apt-get download --print-uris "$KPKG" $PACKAGES) || die "apt-get download --print-uris failed"
# lines: 'URI' FILENAME SIZE SHA256:HEX  -> "FILENAME HEX"
DEBLIST=$(echo "$URIS" | awk '{ sub(/^SHA256:/, "", $4); print $2, $4 }' | sort)
[ "$(echo "$DEBLIST" | wc -l)" -ge 8 ] || die "unexpected apt-get output: $URIS"

# --- 2. input hash: deb versions + minos/ + agent sources + options ---
input_files() {
    (cd "$REPO" && find minos src/layerpy/agent src/layerpy/proto -type f \
        ! -path 'minos/out/*' ! -path 'minos/out-*/*' ! -name '*.pyc' ! -path '*/__pycache__/*' -print
    echo src/layerpy/__init__.py) | sort
}
INPUT_HASH=$({
    echo "$DEBLIST"
    echo "opts arch=$ARCH compress=$COMPRESS epoch=$SOURCE_DATE_EPOCH kernel=$KPKG modules=$MODULES"
    echo "firmware=${LAYERPY_MINOS_FIRMWARE:-}"
    input_files | (cd "$REPO" && xargs sha256sum)
} | sha256sum | cut -c1-64)

STAMP=$OUT/.stamp
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$INPUT_HASH" ]; then
    INITRD=$OUT/$(sed -n 2p "$STAMP")
    if [ -f "$INITRD" ] && [ -f "$OUT/vmlinuz" ]; then
        echo "minos: up to date: $INITRD $(size_line "$INITRD")"
        exit 0
    fi
fi

# The outputs of the last few builds, by input hash: another checkout of the same sources
# (a fresh clone in CI) takes them instead of building again. Checked by their hashes.
BUILT=$CACHE/minos-out/$INPUT_HASH
install_outputs() { # $1: vmlinuz, BUILDINFO, manifest.txt and the initrd BUILDINFO names
    local from=$1 chosen
    chosen=$(sed -n 's/^initrd=//p' "$from/BUILDINFO")
    mkdir -p "$OUT"
    rm -f "$OUT/minos.cpio.gz" "$OUT/minos.cpio.zst" "$OUT/initrd"
    cp "$from/$chosen" "$OUT/$chosen"
    ln -s "$chosen" "$OUT/initrd"
    cp "$from/vmlinuz" "$from/BUILDINFO" "$from/manifest.txt" "$OUT/"
    printf '%s\n%s\n' "$INPUT_HASH" "$chosen" >"$STAMP"
}
if [ "$FORCE" = 0 ] && [ -f "$BUILT/BUILDINFO" ] && [ -f "$BUILT/manifest.txt" ] &&
    (cd "$BUILT" && grep -E '^[0-9a-f]{64}  ' BUILDINFO | sha256sum --quiet --check --status -); then
    install_outputs "$BUILT"
    INITRD=$OUT/$(sed -n 2p "$STAMP")
    echo "minos: built before from the same inputs ($BUILT): $INITRD $(size_line "$INITRD")"
    exit 0
fi

# --- 3. download what the cache lacks, check hashes ---
mkdir -p "$DEBS"
need=()
while read -r file sha; do
    if [ ! -f "$DEBS/$file" ] || [ "$(sha256sum <"$DEBS/$file" | cut -c1-64)" != "$sha" ]; then
        name=${file%%_*}
        need+=("$name")
    fi
done <<<"$DEBLIST"
if [ ${#need[@]} -gt 0 ]; then
    log "downloading ${need[*]}"
    if ! (cd "$DEBS" && "${APT[@]}" apt-get download -q -o APT::Sandbox::User=root "${need[@]}" >&2); then
        # Stale lists name versions the mirror no longer has: refresh and start over.
        [ -z "${LAYERPY_MINOS_UPDATED:-}" ] || die "apt-get download failed"
        log "download failed; running apt-get update and starting over"
        "${APT[@]}" apt-get update -qq >&2
        LAYERPY_MINOS_UPDATED=1 exec bash "$0" "${ARGS[@]}"
    fi
fi
while read -r file sha; do
    [ "$(sha256sum <"$DEBS/$file" | cut -c1-64)" = "$sha" ] || die "$file: sha256 mismatch"
done <<<"$DEBLIST"

# --- 4. unpack all debs into a scratch root ---
ROOT=$WORK/root
RFS=$WORK/rootfs
rm -rf "$WORK"
mkdir -p "$ROOT" "$RFS" "$OUT"
while read -r file _; do
    dpkg-deb -x "$DEBS/$file" "$ROOT"
done <<<"$DEBLIST"
KVER=$(basename "$(ls -d "$ROOT"/lib/modules/*/ | head -n1)")
[ -f "$ROOT/boot/vmlinuz-$KVER" ] || die "no vmlinuz for $KVER in $KPKG"
LIBDIR=lib/$TRIPLET
PYV=$(echo "$DEBLIST" | sed -n 's/^python3\.11-minimal_\([0-9.]*\)-.*/\1/p')
PYENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONPATH="$WORK/layerpy-src"
    PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH")
if [ "$NATIVE" = 1 ]; then # the interpreter that ships traces and compiles
    PY=("$ROOT/$LIBDIR/$LDSO" --library-path "$ROOT/$LIBDIR:$ROOT/usr/$LIBDIR" "$ROOT/usr/bin/python3.11")
    PYENV+=(PYTHONHOME="$ROOT/usr")
else # the host's python3.11: the same stdlib sources and byte code (one .pyc magic per 3.x)
    PY=(/usr/bin/python3.11)
    [ -x "${PY[0]}" ] || die "building for $ARCH needs the host's python3.11 (apt-get install python3.11)"
    HOSTPYV=$("${PY[@]}" -S -c 'import sys; print(sys.version.split()[0])')
    [ "${HOSTPYV%.*}" = "${PYV%.*}" ] || die "host python $HOSTPYV cannot compile for python $PYV"
fi
log "kernel $KVER ($KPKG), python $PYV, $ARCH"

# --- 5. the initramfs tree ---
cd "$RFS"
mkdir -p bin sbin usr/bin usr/sbin usr/lib usr/share/udhcpc etc root proc sys dev run tmp \
    mnt var "$LIBDIR" "$(dirname "$INTERP")" usr/lib/layerpy
chmod 0700 root
chmod 1777 tmp
ln -s /run var/run
ln -s /tmp var/tmp
mknod -m 600 dev/console c 5 1 # the kernel opens it for /init before devtmpfs is mounted
mknod -m 666 dev/null c 1 3

# busybox and its applet links: the staged busybox lists them, or for another architecture
# the host's busybox-static of the same version (Debian builds it with one configuration)
install -m 0755 "$ROOT/bin/busybox" bin/busybox
LIST_APPLETS=$ROOT/bin/busybox
if [ "$NATIVE" = 0 ]; then
    LIST_APPLETS=/bin/busybox
    want=$(echo "$DEBLIST" | sed -n 's/^busybox-static_\([^_]*\)_.*/\1/p' | sed 's/%3a/:/; s/+b[0-9]*$//')
    have=$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null | sed 's/+b[0-9]*$//') || true
    [ "$have" = "$want" ] || die "the host's busybox-static is ${have:-not installed}, not $want: its applet list is needed"
fi
"$LIST_APPLETS" --list-full | while read -r applet; do
    case "$applet" in linuxrc | bin/busybox) continue ;; esac
    [ -e "$applet" ] || [ -L "$applet" ] || ln -s /bin/busybox "$applet"
done

# python and the shared libraries it (and the kept extension modules) load
install -m 0755 "$ROOT/usr/bin/python3.11" usr/bin/python3.11
ln -s python3.11 usr/bin/python3

# layerpy subset: __init__, agent/, proto/ (sources copied to a scratch tree first)
LPSRC=$WORK/layerpy-src
mkdir -p "$LPSRC/layerpy"
cp "$SRC/__init__.py" "$LPSRC/layerpy/"
for sub in agent proto; do
    mkdir -p "$LPSRC/layerpy/$sub"
    if [ -d "$SRC/$sub" ]; then
        (cd "$SRC/$sub" && find . -name '*.py' ! -path '*/__pycache__/*' -print0 |
            xargs -0 -r cp --parents -t "$LPSRC/layerpy/$sub")
    fi
    [ -f "$LPSRC/layerpy/$sub/__init__.py" ] || : >"$LPSRC/layerpy/$sub/__init__.py"
done

# stdlib: trace what the agent imports, byte-compile just that (sourceless, -OO); traced on
# the host, the extension modules are named for its triplet: the staged ones are the target's
HOSTTRIPLET=$("${PYENV[@]}" "${PY[@]}" -S -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH"))')
"${PYENV[@]}" "${PY[@]}" -s "$HERE/trim.py" trace |
    sed "s/-$HOSTTRIPLET\.so\$/-$TRIPLET.so/" >"$WORK/stdlib.list"
while read -r rel; do
    [ -f "$ROOT/usr/lib/python3.11/$rel" ] || die "the agent imports $rel, which the $ARCH python lacks"
done <"$WORK/stdlib.list"
log "stdlib: $(wc -l <"$WORK/stdlib.list") modules kept"
"${PYENV[@]}" "${PY[@]}" -s "$HERE/trim.py" install "$WORK/stdlib.list" \
    "$ROOT/usr/lib/python3.11" "$RFS/usr/lib/python3.11" /usr/lib/python3.11 2
(cd "$LPSRC" && find layerpy -name '*.py' | sort) >"$WORK/layerpy.list"
"${PYENV[@]}" "${PY[@]}" -s "$HERE/trim.py" install "$WORK/layerpy.list" \
    "$LPSRC" "$RFS/usr/lib/layerpy" /usr/lib/layerpy 0

# shared libraries: what python3.11 and the kept .so files need (read from their ELF headers)
copy_lib() { # path under $ROOT -> same path under $RFS, following symlinks
    local rel=$1 target
    [ -e "$RFS/$rel" ] && return
    mkdir -p "$RFS/$(dirname "$rel")"
    if [ -L "$ROOT/$rel" ]; then
        target=$(readlink "$ROOT/$rel")
        ln -s "$target" "$RFS/$rel"
        copy_lib "$(dirname "$rel")/$target"
    else
        install -m 0755 "$ROOT/$rel" "$RFS/$rel"
    fi
}
ELFS=("$ROOT/usr/bin/python3.11")
while read -r so; do ELFS+=("$ROOT/usr/lib/python3.11/$so"); done < <(grep '\.so$' "$WORK/stdlib.list" || true)
LIBS=$(python3 "$HERE/elfdeps.py" "$ROOT" "$LIBDIR" "usr/$LIBDIR" -- "${ELFS[@]}") || die "a library is missing"
for lib in $LIBS; do copy_lib "$lib"; done
[ -e "$RFS/$LIBDIR/$LDSO" ] || install -m 0755 "$ROOT/$LIBDIR/$LDSO" "$RFS/$LIBDIR/$LDSO"
ln -s "/$LIBDIR/$LDSO" "$INTERP"

# kernel modules and their dependencies
MODDIR=lib/modules/$KVER
depmod -b "$ROOT" "$KVER"
mkdir -p "$RFS/$MODDIR"
# shellcheck disable=SC2086
for m in $MODULES; do
    modprobe -d "$ROOT" -S "$KVER" --show-depends "$m" || die "module $m not in $KPKG"
done | awk '$1 == "insmod" { print $2 }' | sort -u | while read -r ko; do
    rel=${ko#"$ROOT"/}
    mkdir -p "$RFS/$(dirname "$rel")"
    install -m 0644 "$ko" "$RFS/$rel"
done
cp "$ROOT/$MODDIR/modules.builtin" "$ROOT/$MODDIR/modules.builtin.modinfo" "$RFS/$MODDIR/"
# firmware files some NICs load (from the packages in LAYERPY_MINOS_FIRMWARE_DEBS)
for fw in ${LAYERPY_MINOS_FIRMWARE:-}; do
    [ -f "$ROOT/lib/firmware/$fw" ] || die "firmware $fw is in none of: ${LAYERPY_MINOS_FIRMWARE_DEBS:-(no debs)}"
    install -D -m 0644 "$ROOT/lib/firmware/$fw" "$RFS/lib/firmware/$fw"
done
(cd "$RFS/$MODDIR" && find kernel -name '*.ko' | sort) >"$WORK/kept.ko"
grep -Fxf "$WORK/kept.ko" "$ROOT/$MODDIR/modules.order" >"$RFS/$MODDIR/modules.order" || true
depmod -b "$RFS" "$KVER"

# minOS files: /init, inittab, udhcpc hook, agent wrapper, a few /etc basics
install -m 0755 "$HERE/init" init
install -m 0644 "$HERE/inittab" etc/inittab
install -m 0755 "$HERE/udhcpc.script" usr/share/udhcpc/default.script
install -m 0755 "$HERE/agent-run" usr/lib/layerpy/agent-run
install -m 0644 "$HERE/profile" etc/profile
printf 'root::0:0:root:/root:/bin/sh\n' >etc/passwd
printf 'root:x:0:\n' >etc/group
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >etc/hosts
printf 'hosts: files dns\n' >etc/nsswitch.conf
: >etc/resolv.conf
{
    echo "NAME=\"layerpy minOS\""
    echo "ARCH=$ARCH"
    echo "KERNEL=$KVER"
    echo "PYTHON=$PYV"
    echo "INPUTS=$INPUT_HASH"
    echo "$DEBLIST" | awk '{ print "DEB=" $1 }'
} >etc/minos-release

# --- 6. check the tree: the agent's code paths import inside it (a chroot, no network) ---
if [ "$NATIVE" = 1 ]; then
    chroot "$RFS" /usr/bin/env -i PATH=/sbin:/usr/sbin:/bin:/usr/bin PYTHONHOME=/usr \
        PYTHONPATH=/usr/lib/layerpy PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 - verify \
        <"$HERE/trim.py" >&2 || die "the trimmed python cannot run the agent"
else
    log "no chroot check: $ARCH binaries do not run here (tests/e2e/test_arm64.py boots it)"
fi
rm -f etc/resolv.conf && : >etc/resolv.conf

# --- 7. pack: sorted entries, fixed mtimes and owners ---
find . -mindepth 1 -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
find . -mindepth 1 -printf '%P\n' | sort |
    cpio --quiet --reproducible -H newc -o -R 0:0 >"$WORK/minos.cpio"
(find . -mindepth 1 -printf '%y %m %s %P\n' | sort -k4) >"$WORK/manifest.txt"
gz() { gzip -9 -n -c "$WORK/minos.cpio" >"$WORK/minos.cpio.gz"; }
zs() { zstd -q -19 -T1 -c "$WORK/minos.cpio" >"$WORK/minos.cpio.zst"; }
case "$COMPRESS" in
gzip) gz; CHOSEN=minos.cpio.gz ;;
zstd) zs; CHOSEN=minos.cpio.zst ;;
auto)
    gz
    if command -v zstd >/dev/null && grep -qx 'CONFIG_RD_ZSTD=y' "$ROOT/boot/config-$KVER"; then
        zs
        if [ "$(stat -c %s "$WORK/minos.cpio.zst")" -lt "$(stat -c %s "$WORK/minos.cpio.gz")" ]; then
            CHOSEN=minos.cpio.zst
        else
            CHOSEN=minos.cpio.gz
        fi
        log "gzip -9: $(size_line "$WORK/minos.cpio.gz"), zstd -19: $(size_line "$WORK/minos.cpio.zst")"
    else
        CHOSEN=minos.cpio.gz
    fi
    ;;
esac
rm -rf "$BUILT.new"
mkdir -p "$BUILT.new"
cp "$WORK/$CHOSEN" "$WORK/manifest.txt" "$BUILT.new/"
cp "$ROOT/boot/vmlinuz-$KVER" "$BUILT.new/vmlinuz"
{
    echo "arch=$ARCH"
    echo "kernel=$KVER"
    echo "kernel_package=$KPKG"
    echo "python=$PYV"
    echo "initrd=$CHOSEN"
    echo "inputs=$INPUT_HASH"
    (cd "$BUILT.new" && sha256sum vmlinuz "$CHOSEN")
    echo "$DEBLIST" | awk '{ print "deb " $1 }'
} >"$BUILT.new/BUILDINFO"
rm -rf "$BUILT"
mv "$BUILT.new" "$BUILT"
install_outputs "$BUILT"
# keep the outputs of the four newest builds
find "$CACHE/minos-out" -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' | sort -rn |
    tail -n +5 | cut -d' ' -f2- | xargs -r rm -rf

SIZE=$(stat -c %s "$OUT/$CHOSEN")
ELAPSED=$(awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "minos: kernel $OUT/vmlinuz ($KVER, $(size_line "$OUT/vmlinuz"))"
echo "minos: initramfs $OUT/$CHOSEN ($( [ "$CHOSEN" = minos.cpio.zst ] && echo zstd || echo gzip)," \
    "$(size_line "$OUT/$CHOSEN"), cpio $(size_line "$WORK/minos.cpio")) in ${ELAPSED} s"
[ "$SIZE" -le $((10 * 1048576)) ] || die "initramfs is over the 10 MB hard limit"
[ "$SIZE" -le $((9 * 1048576)) ] || log "warning: initramfs is over the 9 MB target"

#!/usr/bin/env bash
# Installs everything the lab and the tests need on Debian 12, idempotently:
# Debian packages, the project's venv, and the minOS (kernel + initramfs) for amd64 and
# arm64 (the arm64 .debs through minos/apt-arch.sh: the host's dpkg architectures and apt
# sources stay as they are).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  python3-venv qemu-system-x86 qemu-utils ipxe ovmf busybox-static udhcpc
  isc-dhcp-client isc-dhcp-relay tftp-hpa atftp curl iproute2 cpio zstd kmod gzip ipmitool
  umoci skopeo docker-registry squashfs-tools-ng mmdebstrap dnsmasq-base systemd-container
  ansible-core slurmctld slurm-client munge chromium prometheus etcd-server etcd-client
  iptables openssl qemu-system-arm qemu-efi-aarch64
)

vm-lab/install-packages.sh "${PACKAGES[@]}"

# The venv, rebuilt only when pyproject.toml changes.
stamp=.venv/.layerpy-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: creating the venv"
  /usr/bin/python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  echo "$want" > "$stamp"
fi

# Debian's signed shim and GRUB netboot image, for the Secure Boot path (docs/secure-boot.md)
# of x86-64 and arm64 UEFI
vm-lab/signed-loaders.sh amd64 arm64

# The lab's [ipxe] dir: Debian 12's x86 iPXE binaries and Debian 13's arm64 one
vm-lab/ipxe-arm64.sh

minos/build.sh
minos/build.sh --arch arm64

# The Raspberry Pi firmware layerpy serves by TFTP ([rpi] dir): its failure stops only Pi boots.
vm-lab/rpi-firmware.sh || echo "setup: no Raspberry Pi firmware in /var/cache/layerpy/rpi (above: why)"

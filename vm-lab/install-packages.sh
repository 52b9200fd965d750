#!/usr/bin/env bash
# Installs the named Debian packages that are missing, and leaves every daemon they bring
# stopped and disabled at boot: the lab and the tests run them by hand inside their own
# network namespaces, never on this host. Says what it installed and what it disabled.
# Usage: vm-lab/install-packages.sh PACKAGE...   (as root; idempotent)
set -euo pipefail

# Package scripts may not start a daemon now...
if [ ! -x /usr/sbin/policy-rc.d ] || ! grep -q "exit 101" /usr/sbin/policy-rc.d; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
fi

missing=()
for package in "$@"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$package")
done
installed=()
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: ${missing[*]}"
  before=$(dpkg-query -W -f='${Package}\n' | sort)
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # the named packages and what they pulled in (nginx-light brings nginx and its unit)
  mapfile -t installed < <(comm -13 <(echo "$before") <(dpkg-query -W -f='${Package}\n' | sort))
fi

# ...and their postinst enables them at boot all the same: undo that, for what this run
# installed (a package that was here before, and an admin's choices, stay as they were).
for package in "${installed[@]}"; do
  for unit in $(dpkg -L "$package" 2>/dev/null \
      | sed -nE 's#^/(usr/)?lib/systemd/system/([^/@]+\.(service|socket|timer|path|target))$#\2#p; s#^/etc/init\.d/([^/]+)$#\1#p' \
      | sed -E 's/\.service$//' | sort -u); do
    if [ "$(systemctl is-enabled "$unit" 2>/dev/null)" = enabled ]; then
      systemctl disable --quiet "$unit" 2>/dev/null
      echo "install: $unit (from $package) disabled at boot; it runs only inside test namespaces"
    fi
  done
done

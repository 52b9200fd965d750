"""Start a systemd container's init in a cgroup namespace of its own.

    python3 -m layerpy.agent.cgroupns BUSYBOX ROOT COMMAND...

Under systemd-nspawn a container's systemd sees its own cgroup as the root of
/sys/fs/cgroup; software that walks the tree from the top (slurmd looks for the scope it
asked systemd for under /sys/fs/cgroup/system.slice) relies on that. busybox ``unshare``
has no cgroup option and Python 3.11 no ``os.unshare``, so this calls unshare(2) through
ctypes, mounts a cgroup2 file system seen from the new namespace on ROOT/sys/fs/cgroup
(in place of the host's, in the container's own mount namespace),
and execs COMMAND. Without a namespace (an old kernel) it says so and runs COMMAND anyway.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

CLONE_NEWCGROUP = 0x02000000


def main() -> None:
    busybox, root, *command = sys.argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWCGROUP) != 0:
        why = os.strerror(ctypes.get_errno())
        print(f"layerpy: no cgroup namespace for the container ({why})", file=sys.stderr)
    else:  # the kernel refuses cgroup2 over cgroup2 (EBUSY): the host's view goes first
        where = f"{root}/sys/fs/cgroup"
        subprocess.run([busybox, "umount", "-l", where], check=False)
        mount = [busybox, "mount", "-t", "cgroup2", "-o", "nosuid,nodev,noexec", "cgroup2"]
        if subprocess.run([*mount, where], check=False).returncode:
            print("layerpy: cannot mount the container's cgroup2; it sees the host's",
                  file=sys.stderr)  # fmt: skip
            subprocess.run([busybox, "mount", "--bind", "/sys/fs/cgroup", where], check=False)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()

"""What the firmware says of this boot: whether Secure Boot was on.

UEFI keeps it in the global variable ``SecureBoot`` (UEFI 2.x, section 3.3): efivarfs shows
each variable as a file of 4 bytes of attributes and then its data, here one byte, 1 when
Secure Boot is enforced. A BIOS machine has no ``/sys/firmware/efi`` at all. The minOS
mounts efivarfs read-only at start (minos/init); a kernel without it leaves the directory
empty, and then nothing can be said.
"""

from __future__ import annotations

import os

EFI = "/sys/firmware/efi"
EFIVARS = EFI + "/efivars"
# the variable's name and EFI_GLOBAL_VARIABLE's GUID
SECURE_BOOT = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
ATTRIBUTES = 4  # bytes before a variable's data in an efivarfs file


def secure_boot(efi: str = EFI) -> bool | None:
    """True when the firmware booted this node with Secure Boot on, False when off (or a
    BIOS machine), None when it cannot be told (UEFI, but its variables are not readable,
    or the variable holds something else than 0 or 1)."""
    if not os.path.isdir(efi):
        return False  # BIOS: no Secure Boot
    variables = os.path.join(efi, "efivars")
    try:
        with open(os.path.join(variables, SECURE_BOOT), "rb") as f:
            data = f.read(ATTRIBUTES + 2)
    except FileNotFoundError:
        # UEFI without the variable (firmware that predates Secure Boot) is off; an
        # efivarfs that is not mounted shows an empty directory: nothing to tell
        try:
            return False if os.listdir(variables) else None
        except OSError:
            return None
    except OSError:
        return None
    if len(data) != ATTRIBUTES + 1 or data[-1] not in (0, 1):
        return None
    return data[-1] == 1

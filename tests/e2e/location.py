"""What the location e2e tests share: a node file named by switch ports, and strangers."""

from __future__ import annotations

from pathlib import Path

from lab import VmSpec
from session import lab_text


def located_node_file(run_dir: Path, identity: str, discover: bool = False) -> Path:
    """The lab's nodes with no MACs and no BMCs, named by sw1's ports swp1-swp4 only,
    under the `identity` policy."""
    text = lab_text()
    lines = [line for line in text.splitlines() if not line.startswith(("mac =", "bmc ="))]
    text = "\n".join(lines).replace(
        'nodes = "cn[001-004]"', 'nodes = "cn[001-004]"\nlocation = "sw1:swp[1-4]"'
    )
    text += '\n[switches.sw1]\nchassis_id = "02:00:00:00:0a:01"\nrelay = "10.99.0.254"\n'
    text = text.replace("[server]\n", f'[server]\nidentity = "{identity}"\n', 1)
    if discover:
        text = text.replace(
            'pool = "10.99.0.200-10.99.0.250"', 'pool = "10.99.0.200-10.99.0.250"\ndiscover = true'
        )
    path = run_dir / "nodes.toml"
    path.write_text(text)
    return path


def stranger(name: str, last: int) -> VmSpec:
    """A machine whose MAC is in no file."""
    return VmSpec(name, f"52:54:00:aa:00:{last:02x}", "bios")


def plug(lab, tap: str, port: str) -> None:
    """Put one more tap on a relay port's segment (a hub in front of the port)."""
    if lab.run(["ip", "link", "show", tap], check=False).returncode:
        lab.run(["ip", "tuntap", "add", "dev", tap, "mode", "tap"])
    lab.run(["sysctl", "-qw", f"net.ipv6.conf.{tap}.disable_ipv6=1"])
    lab.run(["ip", "link", "set", tap, "master", f"pb-{port}", "up"])

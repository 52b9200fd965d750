"""The node file: a valid one, and broken ones with the exact error each must give."""

from __future__ import annotations

import gc
import textwrap
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from layerpy import bundle
from layerpy.config import ConfigError, load
from layerpy.server import collector_paused

VALID = """\
[server]
interface = "br0"
address = "10.99.0.1"
http_port = 8080
state_dir = "state"

[network]
subnet = "10.99.0.0/24"
gateway = "10.99.0.1"
dns = ["10.99.0.1"]
pool = "10.99.0.200-10.99.0.250"

[minos]
kernel = "vmlinuz"
initrd = "minos.img"
cmdline = "console=ttyS0"

[ipxe]
dir = "ipxe"

[groups.compute]
nodes = "cn[001-003]"
ip = "10.99.0.[11-13]"
mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]

[nodes.cn003]
ip = "10.99.0.23"

[nodes.login]
ip = "10.99.0.5"
mac = "52-54-00-99-00-05"
"""


@pytest.fixture
def write(tmp_path: Path):
    (tmp_path / "vmlinuz").write_bytes(b"k")
    (tmp_path / "minos.img").write_bytes(b"i")
    (tmp_path / "ipxe").mkdir()
    for name in ("undionly.kpxe", "snponly.efi"):
        (tmp_path / "ipxe" / name).write_bytes(b"x")

    def write(text: str) -> Path:
        path = tmp_path / "nodes.toml"
        path.write_text(textwrap.dedent(text))
        return path

    return write


def test_valid_file(write) -> None:
    config = load(write(VALID))
    assert list(config.nodes) == ["cn001", "cn002", "cn003", "login"]
    assert config.nodes["cn002"].ip == IPv4Address("10.99.0.12")
    assert config.nodes["cn003"].ip == IPv4Address("10.99.0.23")  # override
    assert config.nodes["cn003"].mac == "52:54:00:99:00:13"  # kept from the group
    assert config.nodes["login"].mac == "52:54:00:99:00:05"  # normalised
    assert config.nodes["cn001"].group == "compute"
    assert config.server.state_dir == config.path.parent / "state"
    assert config.server.url == "http://10.99.0.1:8080"


BROKEN = {
    "syntax error": (
        ("[server\naddress = 1", None),
        [
            "nodes.toml:1: TOML syntax error: Expected ']' at the end of a table declaration (at line 1, column 8)"
        ],
    ),
    "unknown key": (
        (
            '[network]\nsubnet = "10.99.0.0/24"\n',
            '[network]\nsubnet = "10.99.0.0/24"\nsubnett = "x"\n',
        ),
        [
            "nodes.toml:9: network.subnett: unknown key (known keys: discover, dns, domain, gateway, lease_time, pool, subnet)"
        ],
    ),
    "unknown section": (
        ("[ipxe]", "[ipx]"),
        [
            "nodes.toml:18: ipx: unknown section (known: server, network, minos, ipxe, signed, api, images, switches, groups, nodes, files, cluster, rpi)"
        ],
    ),
    "wrong type": (
        ("http_port = 8080", 'http_port = "8080"'),
        ["nodes.toml:4: server.http_port: must be an integer, not a string"],
    ),
    "bad port": (
        ("http_port = 8080", "http_port = 80800"),
        ["nodes.toml:4: server.http_port: 80800 is not a port number (1-65535)"],
    ),
    "uneven ranges": (
        ('ip = "10.99.0.[11-13]"', 'ip = "10.99.0.[11-12]"'),
        [
            "nodes.toml:23: groups.compute.ip: has 2 entries for 3 nodes; ranges must have the same length"
        ],
    ),
    "duplicate ip": (
        ('ip = "10.99.0.5"', 'ip = "10.99.0.12"'),
        ["nodes.toml:29: nodes.login: login has IP 10.99.0.12, already used by cn002"],
    ),
    "duplicate mac": (
        ('mac = "52-54-00-99-00-05"', 'mac = "52:54:00:99:00:11"'),
        ["nodes.toml:29: nodes.login: login has MAC 52:54:00:99:00:11, already used by cn001"],
    ),
    "duplicate name across groups": (
        (
            "[nodes.cn003]",
            '[groups.more]\nnodes = "cn[003-004]"\nip = "10.99.0.[31-32]"\n\n[nodes.cn003]',
        ),
        ["nodes.toml:27: groups.more.nodes: node cn003 is already defined by groups.compute.nodes"],
    ),
    "ip outside subnet": (
        ('ip = "10.99.0.5"', 'ip = "10.98.0.5"'),
        ["nodes.toml:29: nodes.login: login's IP 10.98.0.5 is outside network.subnet 10.99.0.0/24"],
    ),
    "ip in pool": (
        ('ip = "10.99.0.5"', 'ip = "10.99.0.201"'),
        ["nodes.toml:29: nodes.login: login's IP 10.99.0.201 lies inside network.pool"],
    ),
    "server address outside subnet": (
        ('address = "10.99.0.1"', 'address = "10.100.0.1"'),
        ["nodes.toml:3: server.address: 10.100.0.1 is outside network.subnet 10.99.0.0/24"],
    ),
    "bad mac": (
        ('mac = "52-54-00-99-00-05"', 'mac = "52:54:00:99:00"'),
        [
            "nodes.toml:31: nodes.login.mac: '52:54:00:99:00' is not a MAC address like 52:54:00:12:34:56"
        ],
    ),
    "bad hostlist": (
        ('nodes = "cn[001-003]"', 'nodes = "cn[001-003"'),
        ["nodes.toml:22: groups.compute.nodes: 'cn[001-003': '[' is never closed"],
    ),
    "missing kernel": (
        ('kernel = "vmlinuz"', 'kernel = "missing"'),
        [],  # set in the test: the message holds the temporary path
    ),
    "bad dhcp mode": (
        ("http_port = 8080", 'http_port = 8080\ndhcp = "sometimes"'),
        ["nodes.toml:5: server.dhcp: 'sometimes' is not one of: authoritative, proxy, off"],
    ),
    "missing subnet": (
        ('subnet = "10.99.0.0/24"\n', ""),
        ["nodes.toml:7: network.subnet: is required"],
    ),
    "node without ip": (
        ('[nodes.login]\nip = "10.99.0.5"', "[nodes.login]"),
        ["nodes.toml:29: nodes.login.ip: is required"],
    ),
    "operator api in clear off loopback": (
        ("[ipxe]", '[api]\nlisten = ["127.0.0.1:8081", "10.99.0.1:8443"]\n\n[ipxe]'),
        [
            "nodes.toml:19: api.listen: 10.99.0.1:8443 is not loopback: operator tokens would "
            "cross the network in clear; give tls_cert and tls_key, or set plain_http = true"
        ],
    ),
    "operator api half of tls": (
        ("[ipxe]", '[api]\ntls_cert = "vmlinuz"\n\n[ipxe]'),
        ["nodes.toml:18: api: give both tls_cert and tls_key, or neither"],
    ),
    "socket group without socket": (
        ("[ipxe]", '[api]\nsocket_group = "root"\n\n[ipxe]'),
        [
            "nodes.toml:19: api.socket_group: the group cannot reach a socket inside the "
            "state directory (mode 0700): set api.socket too, e.g. /run/layerpy/api.sock"
        ],
    ),
    "socket group unknown": (
        ("[ipxe]", '[api]\nsocket = "/run/x.sock"\nsocket_group = "no-such-group-7"\n\n[ipxe]'),
        ["nodes.toml:20: api.socket_group: no group named 'no-such-group-7' on this machine"],
    ),
    "bad listen address": (
        ("[ipxe]", '[api]\nlisten = ["localhost"]\n\n[ipxe]'),
        [
            "nodes.toml:19: api.listen: 'localhost' must be an address and a port, like "
            "127.0.0.1:8081"
        ],
    ),
    "bad origin": (
        ("[ipxe]", '[api]\norigins = ["https://ops.example.com/dashboard"]\n\n[ipxe]'),
        [
            "nodes.toml:19: api.origins: 'https://ops.example.com/dashboard' is not an "
            'origin: give scheme, host and port only, like "https://ops.example.com:8443" '
            "(no path)"
        ],
    ),
    "credentials in clear": (
        (
            "[ipxe]",
            '[images.a]\nsource = "registry://10.99.0.1:5000/lab/a:1"\ninsecure = true\n'
            'user = "u"\npassword_env = "HOME"\n\n[ipxe]',
        ),
        [
            "nodes.toml:20: images.a.insecure: credentials go only over TLS (or loopback): "
            "drop insecure, or the user and password"
        ],
    ),
    "bad persist disk": (
        (
            '[nodes.login]\nip = "10.99.0.5"',
            '[nodes.login]\nip = "10.99.0.5"\npersist_disk = "sda; reboot"',
        ),
        [
            "nodes.toml:31: nodes.login.persist_disk: 'sda; reboot' must be a device like "
            "/dev/vdb or a label like LABEL=state"
        ],
    ),
    "node is the server": (
        ('ip = "10.99.0.5"', 'ip = "10.99.0.1"'),
        ["nodes.toml:29: nodes.login: login's IP 10.99.0.1 is the server's own address"],
    ),
    # found by tests/fuzz: tomllib raises a plain ValueError (not TOMLDecodeError) for an
    # integer over Python's 4300-digit limit, which escaped load()
    "a number of 5000 digits": (
        ('state_dir = "state"', 'state_dir = "state"\nheartbeat = ' + "9" * 5000),
        ["nodes.toml:6: a number of more than 4300 digits (no setting takes one)"],
    ),
    # found by tests/fuzz: float() of a 401-digit integer raised OverflowError out of load()
    "a number beyond a float": (
        ('state_dir = "state"', 'state_dir = "state"\nheartbeat = 1' + "0" * 400),
        ["nodes.toml:6: server.heartbeat: is too large"],
    ),
    "not a number": (
        ('state_dir = "state"', 'state_dir = "state"\nsend_timeout = nan'),
        ["nodes.toml:6: server.send_timeout: must be a finite number, not nan"],
    ),
    # found by tests/fuzz: Path.is_file() raises OSError for a name too long to look up
    "ipxe dir name too long": (
        ('dir = "ipxe"', 'dir = "' + "x" * 300 + '"'),
        [
            f"nodes.toml:18: ipxe.bios: {'x' * 300}/undionly.kpxe cannot be looked up (File name too long) (install Debian's ipxe package, run vm-lab/ipxe-arm64.sh for arm64, or set ipxe.dir)",
            f"nodes.toml:18: ipxe.uefi: {'x' * 300}/snponly.efi cannot be looked up (File name too long) (install Debian's ipxe package, run vm-lab/ipxe-arm64.sh for arm64, or set ipxe.dir)",
        ],
    ),
    "kernel name too long": (
        ('kernel = "vmlinuz"', 'kernel = "' + "k" * 300 + '"'),
        [
            f"nodes.toml:14: minos.kernel: {'k' * 300} cannot be looked up (File name too long) (build the minOS with minos/build.sh)"
        ],
    ),
    # a lease time DHCP cannot carry failed every reply (OverflowError in to_bytes(4))
    "lease time beyond 32 bits": (
        (
            'pool = "10.99.0.200-10.99.0.250"',
            'pool = "10.99.0.200-10.99.0.250"\nlease_time = 4294967296',
        ),
        [
            "nodes.toml:12: network.lease_time: 4294967296 is not a lease time in seconds (1 to 4294967295)"
        ],
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_file(write, case: str) -> None:
    (old, new), expected = BROKEN[case]
    text = old if new is None else VALID.replace(old, new, 1)
    assert new is None or text != VALID, "the test case did not change the file"
    path = write(text)
    with pytest.raises(ConfigError) as raised:
        load(path)
    rendered = raised.value.render().replace(str(path.parent) + "/", "")
    if case == "missing kernel":
        expected = [
            f"nodes.toml:14: minos.kernel: {path.parent}/missing does not exist "
            "(build the minOS with minos/build.sh)"
        ]
        rendered = raised.value.render().replace(str(path), "nodes.toml")
    assert rendered.splitlines() == expected


def test_a_group_takes_a_range_of_macs(write) -> None:
    text = VALID.replace(
        'mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]',
        'mac = "52:54:00:99:00:fe-52:54:00:99:01:00"',
    )
    config = load(write(text))
    assert [config.nodes[n].mac for n in ("cn001", "cn002", "cn003")] == [
        "52:54:00:99:00:fe",
        "52:54:00:99:00:ff",
        "52:54:00:99:01:00",
    ]
    backwards = text.replace("00:fe-52:54:00:99:01:00", "01:00-52:54:00:99:00:fe")
    with pytest.raises(ConfigError, match="runs backwards"):
        load(write(backwards))


def test_every_problem_is_reported_at_once(write) -> None:
    text = VALID.replace("http_port = 8080", 'http_port = "x"').replace(
        'mac = "52-54-00-99-00-05"', 'mac = "nope"'
    )
    with pytest.raises(ConfigError) as raised:
        load(write(text))
    assert [p.key for p in raised.value.problems] == ["server.http_port", "nodes.login.mac"]


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file: No such file or directory"):
        load(tmp_path / "absent.toml")


POWERED = VALID.replace(
    'mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]\n',
    'mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]\n'
    'bmc = { driver = "ipmi", address = "10.99.1.[11-13]", user = "admin", password_file = "bmc.pass" }\n',
).replace('[nodes.cn003]\nip = "10.99.0.23"', '[nodes.cn003]\nip = "10.99.0.23"\npower = "off"')


def test_power_and_bmc(write) -> None:
    path = write(POWERED + 'bmc = { driver = "qemu", address = "/run/lab/{node}.qmp" }\n')
    (path.parent / "bmc.pass").write_text("s3cret\n")
    config = load(path)
    cn001, cn003, login = (config.nodes[n] for n in ("cn001", "cn003", "login"))
    assert (cn001.power, cn003.power, login.power) == ("on", "off", "on")
    assert (cn001.bmc.driver, cn001.bmc.address, cn001.bmc.user) == ("ipmi", "10.99.1.11", "admin")
    assert cn001.bmc.password == "s3cret" and "s3cret" not in repr(cn001)
    assert (login.bmc.driver, login.bmc.address) == ("qemu", "/run/lab/login.qmp")
    assert (cn001.bmc.console, login.bmc.console) == (None, None)


def test_password_file_not_utf8(write) -> None:
    """Found reading what tests/fuzz reaches: UnicodeDecodeError escaped load()."""
    path = write(POWERED)
    (path.parent / "bmc.pass").write_bytes(b"\xff\xfes3cret\n")
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert raised.value.render() == (
        f"{path}:25: groups.compute.bmc.password_file: {path.parent}/bmc.pass is not UTF-8 text"
    )


def test_problems_quote_no_control_characters(write) -> None:
    """Found by tests/fuzz: an image name with a carriage return (or an escape sequence)
    was quoted raw in the message ``layerpy check`` prints."""
    path = write(VALID.replace("[nodes.cn003]\n", '[nodes.cn003]\nimage = "\\u001b[2J\\rx"\n'))
    with pytest.raises(ConfigError) as raised:
        load(path)
    rendered = raised.value.render()
    assert "\x1b" not in rendered and "\r" not in rendered
    assert rendered == (
        f"{path}:21: groups.compute.image: cn003: no image named '\\x1b[2J\\rx' (defined: none; "
        "add an [images.\\x1b[2J\\rx] table)"
    )


def test_consoles(write) -> None:
    sol = POWERED.replace('user = "admin"', 'user = "admin", console = "sol"')
    path = write(sol + 'bmc = { driver = "none", console = "/run/lab/{node}.console" }\n')
    (path.parent / "bmc.pass").write_text("s3cret\n")
    config = load(path)
    assert config.nodes["cn001"].bmc.console == "sol"
    assert config.nodes["login"].bmc.console == "/run/lab/login.console"
    path.write_text(sol.replace('driver = "ipmi"', 'driver = "redfish"'))
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert 'console: "sol" needs driver "ipmi", not \'redfish\'' in raised.value.render()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('address = "10.99.1.[11-13]"', 'address = "10.99.1.[11-12]"'),
            "nodes.toml:25: groups.compute.bmc.address: has 2 entries for 3 nodes; ranges must have the same length",
        ),
        (
            ('driver = "ipmi"', 'driver = "ipmi2"'),
            "nodes.toml:25: groups.compute.bmc.driver: 'ipmi2' is not one of: ipmi, redfish, qemu, command, none",
        ),
        (
            ('password_file = "bmc.pass"', 'password_file = "absent.pass"'),
            "nodes.toml:25: groups.compute.bmc.password_file: cannot read {dir}/absent.pass: No such file or directory",
        ),
        (
            ('password_file = "bmc.pass"', 'password_env = "LAYERPY_TEST_UNSET"'),
            "nodes.toml:25: groups.compute.bmc.password_env: environment variable LAYERPY_TEST_UNSET is not set",
        ),
        (
            ('power = "off"', 'power = "of"'),
            "nodes.toml:29: nodes.cn003.power: 'of' is not one of: on, off",
        ),
        (
            ('user = "admin"', 'user = "admin", console = "/run/{host}.console"'),
            "nodes.toml:25: groups.compute.bmc.console: '/run/{{host}}.console': the only placeholder is {{node}}",
        ),
        (
            ('user = "admin"', 'user = "admin", console = "ttyS0"'),
            "nodes.toml:25: groups.compute.bmc.console: 'ttyS0' must be \"sol\" (IPMI Serial-over-LAN) or the absolute path of the console's Unix socket, like /run/lab/{{node}}.console",
        ),
        (
            ('address = "10.99.1.[11-13]"', 'address = "/run/{node}/{0}.qmp"'),
            "nodes.toml:25: groups.compute.bmc.address: '/run/{{node}}/{{0}}.qmp': the only placeholder is {{node}}",
        ),
    ],
)
def test_broken_power(write, change, expected) -> None:
    path = write(POWERED.replace(*change))
    (path.parent / "bmc.pass").write_text("s3cret\n")
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert raised.value.render().replace(str(path), "nodes.toml").splitlines() == [
        expected.format(dir=path.parent)
    ]
    assert "s3cret" not in raised.value.render()


def test_ipxe_binary_linking_out_of_the_tftp_root(write) -> None:
    path = write(VALID.replace('dir = "ipxe"', 'dir = "ipxe"\nuefi = "linked.efi"'))
    (path.parent / "elsewhere.efi").write_bytes(b"x")
    (path.parent / "ipxe" / "linked.efi").symlink_to(path.parent / "elsewhere.efi")
    with pytest.raises(
        ConfigError, match=r"outside ipxe\.dir, and TFTP serves only what is inside it"
    ):
        load(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "nodes.toml"
    path.write_bytes(b'[server]\naddress = "\xff"\n')
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert raised.value.render() == f"{path}:2: not UTF-8 text (byte 0xff)"


IMAGED = POWERED.replace(
    "[ipxe]",
    '[images.base]\nsource = "registry://127.0.0.1:5000/lab/base:1"\ninsecure = true\n\n'
    '[images.other]\nsource = "oci-layout:layouts/other:v2"\nsystemd = true\n\n[ipxe]',
)


def test_images(write) -> None:
    path = write(
        IMAGED.replace(
            'password_file = "bmc.pass" }\n', 'password_file = "bmc.pass" }\nimage = "base"\n'
        )
        + 'image = "other"\n'
    )
    (path.parent / "bmc.pass").write_text("s3cret\n")
    config = load(path)
    base, other = config.images["base"], config.images["other"]
    assert (
        base.source.kind,
        base.source.location,
        base.source.reference,
        base.source.insecure,
    ) == ("registry", "127.0.0.1:5000/lab/base", "1", True)
    assert (other.source.kind, other.systemd) == ("oci-layout", True)
    assert (
        other.source.location == str(path.parent / "layouts/other")
        or other.source.location == "layouts/other"
    )
    assert [config.nodes[n].image for n in ("cn001", "cn003", "login")] == ["base", "base", "other"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            (
                '[nodes.cn003]\nip = "10.99.0.23"',
                '[nodes.cn003]\nip = "10.99.0.23"\nimage = "nope"',
            ),
            "groups.compute.image: cn003: no image named 'nope' (defined: base, other; add an [images.nope] table)",
        ),
        (
            ('source = "registry://127.0.0.1:5000/lab/base:1"', 'source = "registry://:::/x"'),
            "nodes.toml:19: images.base.source: image source 'registry://:::/x'",
        ),
        (
            ("systemd = true", 'systemd = "yes"'),
            "nodes.toml:24: images.other.systemd: must be a boolean, not a string",
        ),
        (
            ("systemd = true", "systemd = true\ninsecure = true"),
            "nodes.toml:25: images.other.insecure: applies to registry sources only",
        ),
    ],
)
def test_broken_images(write, change, expected) -> None:
    path = write(IMAGED.replace(*change))
    (path.parent / "bmc.pass").write_text("s3cret\n")
    with pytest.raises(ConfigError) as raised:
        load(path)
    rendered = raised.value.render().replace(str(path), "nodes.toml")
    assert expected in rendered, rendered


LOCATED = VALID.replace(
    "[ipxe]", '[switches.sw1]\nchassis_id = "02-00-00-00-0A-01"\nrelay = "10.99.0.254"\n\n[ipxe]'
).replace('nodes = "cn[001-003]"', 'nodes = "cn[001-003]"\nlocation = "sw1:swp[1-3]"')


def test_locations(write) -> None:
    config = load(write(LOCATED))
    assert config.switches["sw1"].chassis_id == "02:00:00:00:0a:01"
    assert str(config.switches["sw1"].relay) == "10.99.0.254"
    assert [config.nodes[n].location for n in ("cn001", "cn003")] == [
        ("sw1", "swp1"),
        ("sw1", "swp3"),
    ]
    assert config.nodes["login"].location is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('location = "sw1:swp[1-3]"', 'location = "sw2:swp[1-3]"'),
            "groups.compute.location: cn001: no switch named 'sw2' (add a [switches.sw2] table)",
        ),
        (
            ('location = "sw1:swp[1-3]"', 'location = "sw1:swp[1-2]"'),
            "groups.compute.location: has 2 entries for 3 nodes; ranges must have the same length",
        ),
        (
            ("[nodes.login]", '[nodes.login]\nlocation = "sw1:swp2"'),
            "nodes.login.location: login: sw1:swp2 is already cn002's location",
        ),
        (
            ('location = "sw1:swp[1-3]"', 'location = "swp[1-3]"'),
            "groups.compute.location: 'swp1' is not a location like sw1:swp3 (switch:port)",
        ),
        (
            ('chassis_id = "02-00-00-00-0A-01"\nrelay = "10.99.0.254"', "mtu = 9000"),
            "switches.sw1.mtu: unknown key (known keys: chassis_id, relay, relay_sources, remote_id)",
        ),
    ],
)
def test_broken_locations(write, change, expected) -> None:
    with pytest.raises(ConfigError) as raised:
        load(write(LOCATED.replace(*change)))
    assert expected in raised.value.render(), raised.value.render()


def test_a_broken_file_read_with_the_collector_paused_leaves_it_running(write) -> None:
    """layerpy serve and reload read the node file with the cyclic collector paused; a
    refused file must not leave it off (a reload that failed would leak cycles forever)."""
    path = write(VALID.replace('subnet = "10.99.0.0/24"', 'subnet = "nonsense"'))
    assert gc.isenabled()
    with pytest.raises(ConfigError), collector_paused():
        assert not gc.isenabled()
        load(path)
    assert gc.isenabled()


MINOS_SECTION = '[minos]\nkernel = "vmlinuz"\ninitrd = "minos.img"\ncmdline = "console=ttyS0"\n'


def test_without_minos_files_the_bundled_minos_boots(write, monkeypatch, tmp_path) -> None:
    kernel, initrd = tmp_path / "bundled-vmlinuz", tmp_path / "bundled-initrd"
    arm64 = tmp_path / "bundled-vmlinuz-arm64", tmp_path / "bundled-initrd-arm64"
    monkeypatch.setattr(bundle, "minos", lambda arch="amd64": {"amd64": (kernel, initrd)}.get(arch))
    config = load(write(VALID.replace(MINOS_SECTION, '[minos]\ncmdline = "quiet"\n')))
    assert (config.minos.kernel, config.minos.initrd, config.minos.cmdline) == (
        kernel,
        initrd,
        "quiet",
    )
    assert config.minos.files("arm64") is None  # arm64 firmware is then refused, with why
    both = {"amd64": (kernel, initrd), "arm64": arm64}
    monkeypatch.setattr(bundle, "minos", lambda arch="amd64": both[arch])
    assert load(write(VALID.replace(MINOS_SECTION, ""))).minos.files("arm64") == arm64
    config = load(write(VALID.replace(MINOS_SECTION, "")))
    assert config.minos.kernel == kernel


def test_without_minos_files_or_a_bundled_minos_the_file_is_refused(write, monkeypatch) -> None:
    monkeypatch.setattr(bundle, "minos", lambda arch="amd64": None)
    with pytest.raises(ConfigError) as raised:
        load(write(VALID.replace(MINOS_SECTION, "")))
    assert [p.message for p in raised.value.problems] == [
        "no kernel and initrd named, and this layerpy has no minOS of its own (build one with "
        "minos/build.sh, or use layerpy.pyz, which carries one)"
    ]
    with pytest.raises(ConfigError) as raised:
        load(write(VALID.replace('initrd = "minos.img"\n', "")))
    assert [(p.key, p.message) for p in raised.value.problems] == [
        ("minos.initrd", "missing: name the kernel and the initrd, or neither")
    ]


def test_api_origins_are_kept_as_browsers_send_them(write) -> None:
    """Lowercase, without the scheme's default port or a trailing slash."""
    listed = '["HTTPS://Ops.Example.com:443/", "http://10.99.0.1:8081", "https://[::1]:8443"]'
    config = load(write(VALID.replace("[ipxe]", f"[api]\norigins = {listed}\n\n[ipxe]")))
    assert config.api.origins == (
        "https://ops.example.com",
        "http://10.99.0.1:8081",
        "https://[::1]:8443",
    )


COMMANDED = VALID.replace(
    'mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]\n',
    'mac = ["52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13"]\n'
    'bmc = { driver = "command", address = "[1-3]", on = "snmpset -c {community} pdu1 o.{address} i 1", '
    'off = "snmpset -c {community} pdu1 o.{address} i 2", status = "snmpget -c {community} pdu1 o.{address}" }\n'
    'vars = { community = "private" }\n',
)


def test_power_commands(write) -> None:
    """Templates split once and filled per node: the group's variables, a node's own over
    them, a node's own commands; {{ }} are braces, booleans and numbers read as in TOML."""
    text = COMMANDED.replace(
        '[nodes.cn003]\nip = "10.99.0.23"',
        '[nodes.cn003]\nip = "10.99.0.23"\nvars = { community = "it\'s; other" }',
    ) + (
        'bmc = { driver = "command", port = 80, user = "u", on = "curl -d \'{{\\"on\\": {on}}}\' '
        'http://plug-{node}:{port}/", off = "plug off", status = "plug {user} status", '
        'cycle = "plug cycle", boot_network = "plug pxe", status_exit = { on = 0, off = 1 }, '
        "timeout = 5 }\n"
        "vars = { on = true }\n"
    )
    config = load(write(text))
    cn001, cn003, login = (config.nodes[n].bmc.command for n in ("cn001", "cn003", "login"))
    assert cn001.on == ("snmpset", "-c", "private", "pdu1", "o.1", "i", "1")
    assert cn001.status == ("snmpget", "-c", "private", "pdu1", "o.1")
    assert cn003.off == ("snmpset", "-c", "it's; other", "pdu1", "o.3", "i", "2")
    assert (cn001.cycle, cn001.boot_network, cn001.status_exit, cn001.timeout) == ((), (), (), 8.0)
    assert login.on == ("curl", "-d", '{"on": true}', "http://plug-login:80/")
    assert (login.status, login.cycle, login.boot_network) == (
        ("plug", "u", "status"), ("plug", "cycle"), ("plug", "pxe"),
    )  # fmt: skip
    assert (login.status_exit, login.timeout) == (((0, "on"), (1, "off")), 5.0)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('on = "snmpset -c {community} pdu1 o.{address} i 1", ', ""),
            "groups.compute.bmc.on: is required",
        ),
        (
            ('on = "snmpset -c {community} pdu1 o.{address} i 1"', 'on = " "'),
            "groups.compute.bmc.on: is empty: give the program and its arguments",
        ),
        (
            ('on = "snmpset -c', "on = \"snmpset 'x -c"),
            'groups.compute.bmc.on: "snmpset \'x -c {{community}} pdu1 o.{{address}} i 1": '
            "No closing quotation (it is split into arguments like a shell line)",
        ),
        (
            ('on = "snmpset -c {community}', 'on = "snmpset -c {comunity}'),
            "groups.compute.bmc.on: cn001: {{comunity}} is no placeholder: not node, address, "
            "port or user, nor one of its vars (community); add it to vars, or write {{{{ and "
            "}}}} for braces",
        ),
        (
            ('on = "snmpset -c {community}', 'on = "snmpset -c {0}'),
            "groups.compute.bmc.on: 'snmpset -c {{0}} pdu1 o.{{address}} i 1': {{0}} is no "
            "placeholder: write {{name}} (node, address, port, user or a variable), or {{{{ and "
            "}}}} for braces",
        ),
        (
            ('status = "snmpget -c {community}', 'status = "snmpget -c {community!r}'),
            "groups.compute.bmc.status: 'snmpget -c {{community!r}} pdu1 o.{{address}}': "
            "{{community!r}} is no placeholder: write {{name}} (node, address, port, user or a "
            "variable), or {{{{ and }}}} for braces",
        ),
        (
            ('off = "snmpset', 'off = "{ snmpset'),
            "groups.compute.bmc.off: '{{ snmpset -c {{community}} pdu1 o.{{address}} i 2': "
            "Single '{{' encountered in format string; write {{{{ or }}}} for a brace",
        ),
        (
            ("o.{address} i 2", "o.{port} i 2"),
            "groups.compute.bmc.off: cn001: {{port}} is used, but the bmc table sets no port",
        ),
        (
            ('vars = { community = "private" }', "vars = { community = { v = 2 } }"),
            "groups.compute.bmc.on: cn001: {{community}}: vars.community is no string, number "
            "or boolean",
        ),
        (
            ('vars = { community = "private" }', 'vars = { community = "a\\u0000b" }'),
            "groups.compute.bmc.on: cn001: an argument would hold a NUL character, which no "
            "program can get",
        ),
        (
            ('address = "[1-3]"', 'address = "[1-2]"'),
            "groups.compute.bmc.address: has 2 entries for 3 nodes; ranges must have the same "
            "length",
        ),
        (
            ('driver = "command"', 'driver = "command", status_on = "("'),
            "groups.compute.bmc.status_on: '(' is no regular expression: missing ), "
            "unterminated subpattern at position 0",
        ),
        (
            (
                'driver = "command"',
                'driver = "command", status_off = "off", status_exit = { on = 0, off = 1 }',
            ),
            "groups.compute.bmc.status_exit: give status_exit or status_on/status_off, not both",
        ),
        (
            ('driver = "command"', 'driver = "command", status_off = ""'),
            "groups.compute.bmc.status_off: is empty: it would match any output",
        ),
        (
            ('driver = "command"', 'driver = "command", status_exit = { on = 0 }'),
            "groups.compute.bmc.status_exit: must name the exit codes of both states, like "
            "{{ on = 0, off = 1 }}",
        ),
        (
            ('driver = "command"', 'driver = "command", status_exit = { on = 3, off = 3 }'),
            "groups.compute.bmc.status_exit: on and off need different exit codes",
        ),
        (
            ('driver = "command"', 'driver = "command", status_exit = { on = 0, off = 256 }'),
            "groups.compute.bmc.status_exit: exit codes are integers from 0 to 255",
        ),
        (
            ('driver = "command"', 'driver = "command", timeout = 0'),
            "groups.compute.bmc.timeout: 0 must be greater than zero",
        ),
        (
            ('driver = "command"', 'driver = "command", timeout = 10'),
            "groups.compute.bmc.timeout: at most 9 s (a power action runs up to three commands, "
            "boot_network, off and on, in the 30 s the engine gives it)",
        ),
        (
            ('driver = "command"', 'driver = "command", verify_tls = false'),
            "groups.compute.bmc.verify_tls: unknown key (known keys: address, boot_network, "
            "console, cycle, driver, off, on, password_env, password_file, port, status, "
            "status_exit, status_off, status_on, timeout, user)",
        ),
        (
            ('driver = "command"', 'driver = "ipmi"'),
            "groups.compute.bmc.off: unknown key (known keys: address, console, driver, "
            "password_env, password_file, port, user, verify_tls)",
        ),
    ],
)
def test_broken_power_commands(write, change, expected) -> None:
    """Each problem once for each command of the table that gave them, never once per
    node."""
    path = write(COMMANDED.replace(*change))
    with pytest.raises(ConfigError) as raised:
        load(path)
    lines = raised.value.render().replace(str(path), "nodes.toml").splitlines()
    assert lines[0] == "nodes.toml:25: " + expected.format()
    assert not any(other in line for line in lines for other in ("cn002", "cn003")), lines


def test_broken_power_command_of_a_node(write) -> None:
    path = write(
        COMMANDED + 'bmc = { driver = "command", on = "plug {outlet}", off = "x", status = "y" }\n'
    )
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert raised.value.render().replace(str(path), "nodes.toml") == (
        "nodes.toml:34: nodes.login.bmc.on: login: {outlet} is no placeholder: not node, "
        "address, port or user, nor one of its vars (none); add it to vars, or write {{ and }} "
        "for braces"
    )


def test_the_power_command_examples_of_the_docs_load(write) -> None:
    """docs/config.md's PDU, PoE switch and smart plug examples, as written there."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    section = doc.split("### Power by command", 1)[1].split("\n## ", 1)[0]
    examples = [block.split("```", 1)[0] for block in section.split("```toml\n")[1:]]
    assert len(examples) == 3
    config = load(write(VALID + "\n" + "\n".join(examples)))
    pi3, sbc24, node4 = (config.nodes[n].bmc.command for n in ("pi3", "sbc24", "node4"))
    assert pi3.on == ("snmpset", "pdu1.mgmt", ".1.3.6.1.4.1.318.1.1.4.4.2.1.3.3", "i", "1")
    assert sbc24.status[-1] == ".1.3.6.1.2.1.105.1.1.1.3.1.24"
    assert node4.off == (
        "curl",
        "-fsS",
        "--max-time",
        "5",
        "http://plug-4.lab/cm?cmnd=Power%20Off",
    )
    assert (node4.cycle, node4.status_on) == ((), '"POWER":"ON"')

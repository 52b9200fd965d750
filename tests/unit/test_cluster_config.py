"""[cluster] in the node file, and what of the file is an instance's own: the exact
problem each broken table gives, the first key two instances' files differ in, and the
cluster's file combined with an instance's own settings."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from layerpy.config import ConfigError, load, parse_shared
from layerpy.config.shared import ABSENT, combined, first_difference, rest_differs

BASE = """\
[server]
interface = "br0"
address = "10.99.0.1"
state_dir = "state"

[network]
subnet = "10.99.0.0/24"

[minos]
kernel = "vmlinuz"
initrd = "minos.img"

[ipxe]
dir = "ipxe"

[groups.compute]
nodes = "cn[001-002]"
ip = "10.99.0.[11-12]"
image = "base"

[images.base]
source = "oci-layout:base"

[images.other]
source = "oci-layout:other"
"""

CLUSTER = """
[cluster]
etcd = ["http://10.98.0.1:2379", "http://10.98.0.2:2379", "http://10.98.0.3:2379"]
name = "head1"
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("vmlinuz", "minos.img", "ca.pem", "cert.pem", "ipxe/undionly.kpxe",
                 "ipxe/snponly.efi"):  # fmt: skip
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    for name in ("key.pem", "password"):
        (tmp_path / name).write_text("secret\n")
        (tmp_path / name).chmod(0o600)
    return tmp_path


def problems(folder: Path, text: str) -> list[str]:
    path = folder / "nodes.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load(path)
    return raised.value.render().replace(f"{folder}/", "").splitlines()


def test_without_cluster_the_server_is_on_its_own(folder: Path) -> None:
    (folder / "nodes.toml").write_text(BASE)
    assert load(folder / "nodes.toml").cluster is None


def test_defaults(folder: Path) -> None:
    (folder / "nodes.toml").write_text(BASE + CLUSTER)
    cluster = load(folder / "nodes.toml").cluster
    assert cluster is not None
    assert cluster.etcd == (
        "http://10.98.0.1:2379",
        "http://10.98.0.2:2379",
        "http://10.98.0.3:2379",
    )
    assert (cluster.name, cluster.segment, cluster.prefix) == (
        "head1",
        "10.99.0.0/24",
        "/layerpy/v1",
    )
    assert (cluster.lease_ttl, cluster.ca, cluster.user, cluster.password) == (5, None, None, None)


def test_tls_and_credentials(folder: Path) -> None:
    text = (
        BASE
        + """
[cluster]
etcd = ["HTTPS://etcd1.example.com:2379/", "https://[fd00::5]:2379"]
name = "head-2"
segment = "10.99.0.128/25"
prefix = "/site/layerpy"
lease_ttl = 10
ca = "ca.pem"
cert = "cert.pem"
key = "key.pem"
user = "layerpy"
password_file = "password"
"""
    )
    (folder / "nodes.toml").write_text(text)
    cluster = load(folder / "nodes.toml").cluster
    assert cluster is not None
    assert cluster.etcd == ("https://etcd1.example.com:2379", "https://[fd00::5]:2379")
    assert (cluster.name, cluster.segment, cluster.prefix, cluster.lease_ttl) == (
        "head-2", "10.99.0.128/25", "/site/layerpy", 10
    )  # fmt: skip
    assert (cluster.ca, cluster.cert, cluster.key) == (
        folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    )  # fmt: skip
    assert (cluster.user, cluster.password) == ("layerpy", "secret")
    assert "secret" not in repr(cluster)


BROKEN = {
    "no members": (
        'etcd = []\nname = "head1"',
        ["nodes.toml:28: cluster.etcd: names 0 members: give 1 to 7"],
    ),
    "eight members": (
        "etcd = [" + ", ".join(f'"http://10.98.0.{n}:2379"' for n in range(1, 9)) + ']\nname = "a"',
        ["nodes.toml:28: cluster.etcd: names 8 members: give 1 to 7"],
    ),
    "no port": (
        'etcd = ["http://10.98.0.1"]\nname = "head1"',
        [
            "nodes.toml:28: cluster.etcd: 'http://10.98.0.1' is not an etcd member's URL: give "
            'http:// or https://, host and port, like "http://10.0.0.5:2379" (no path)'
        ],
    ),
    "other scheme": (
        'etcd = ["unix:///run/etcd.sock"]\nname = "head1"',
        [
            "nodes.toml:28: cluster.etcd: 'unix:///run/etcd.sock' is not an etcd member's URL: "
            'give http:// or https://, host and port, like "http://10.0.0.5:2379" (no path)'
        ],
    ),
    "a member twice": (
        'etcd = ["http://10.98.0.1:2379", "http://10.98.0.1:2379/"]\nname = "head1"',
        ["nodes.toml:28: cluster.etcd: names http://10.98.0.1:2379 twice"],
    ),
    "no name": (
        'etcd = ["http://10.98.0.1:2379"]',
        ["nodes.toml:27: cluster.name: is required"],
    ),
    "name not a label": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "Head_1"',
        [
            "nodes.toml:29: cluster.name: 'Head_1' must be 1 to 63 lowercase letters, digits "
            "and hyphens, not starting or ending with a hyphen (like a host name)"
        ],
    ),
    "lease too short": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nlease_ttl = 1',
        ["nodes.toml:30: cluster.lease_ttl: 1 is not between 2 and 30 seconds"],
    ),
    "lease not whole": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nlease_ttl = 2.5',
        ["nodes.toml:30: cluster.lease_ttl: must be an integer, not a number"],
    ),
    "prefix with a trailing slash": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nprefix = "/layerpy/"',
        [
            "nodes.toml:30: cluster.prefix: '/layerpy/' must be an etcd key prefix like "
            "/layerpy/v1: parts of letters, digits, '.', '_' and '-', each after a /, none "
            "after the last part"
        ],
    ),
    "segment not a subnet": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nsegment = "rack-1"',
        [
            "nodes.toml:30: cluster.segment: 'rack-1' is not an IPv4 subnet like 10.99.0.0/24 "
            "(Expected 4 octets in 'rack-1')"
        ],
    ),
    "segment outside the network": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nsegment = "10.99.0.0/16"',
        [
            "nodes.toml:30: cluster.segment: 10.99.0.0/16 is not inside network.subnet "
            "10.99.0.0/24: this instance would serve none of the nodes"
        ],
    ),
    "https without ca": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"',
        [
            "nodes.toml:27: cluster.ca: is required for https:// members "
            "(https://10.98.0.1:2379): the CA certificate that signed their certificates"
        ],
    ),
    "ca missing": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"\nca = "nothere.pem"',
        ["nodes.toml:30: cluster.ca: nothere.pem does not exist"],
    ),
    "cert without key": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"\nca = "ca.pem"\ncert = "cert.pem"',
        [
            "nodes.toml:27: cluster: give both cert and key (a client certificate for etcd), or neither"
        ],
    ),
    "cert over http": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\ncert = "cert.pem"\nkey = "key.pem"',
        ["nodes.toml:30: cluster.cert: a client certificate is for https:// members only"],
    ),
    "key readable by all": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"\nca = "ca.pem"\ncert = "cert.pem"\n'
        'key = "open.pem"',
        [
            "nodes.toml:32: cluster.key: open.pem is readable by every user of this host: chmod o-r it"
        ],
    ),
    "password readable by all": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"\nca = "ca.pem"\nuser = "u"\n'
        'password_file = "open.pem"',
        [
            "nodes.toml:32: cluster.password_file: open.pem is readable by every user of this "
            "host: chmod o-r it"
        ],
    ),
    "user without password": (
        'etcd = ["https://10.98.0.1:2379"]\nname = "a"\nca = "ca.pem"\nuser = "u"',
        [
            "nodes.toml:27: cluster: give both user and password_file (etcd's authentication), or neither"
        ],
    ),
    "password in clear": (
        'etcd = ["http://10.98.0.1:2379", "http://127.0.0.1:2379"]\nname = "a"\nuser = "u"\n'
        'password_file = "password"',
        [
            "nodes.toml:31: cluster.password_file: the password would cross the network in "
            "clear to http://10.98.0.1:2379: use https:// members (and ca)"
        ],
    ),
    "unknown key": (
        'etcd = ["http://10.98.0.1:2379"]\nname = "a"\nttl = 5',
        [
            "nodes.toml:30: cluster.ttl: unknown key (known keys: ca, cert, etcd, key, "
            "lease_ttl, name, password_file, prefix, segment, user)"
        ],
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_cluster_table(folder: Path, case: str) -> None:
    table, expected = BROKEN[case]
    (folder / "open.pem").write_text("x")
    (folder / "open.pem").chmod(0o644)
    assert problems(folder, BASE + "\n[cluster]\n" + table + "\n") == expected


def test_a_password_to_loopback_may_go_in_clear(folder: Path) -> None:
    text = BASE + '[cluster]\netcd = ["http://127.0.0.1:2379", "http://localhost:2380"]\n'
    (folder / "nodes.toml").write_text(
        text + 'name = "a"\nuser = "u"\npassword_file = "password"\n'
    )
    cluster = load(folder / "nodes.toml").cluster
    assert cluster is not None and cluster.password == "secret"


# --- an instance's own settings and the cluster's ------------------------------------------


def parsed(text: str) -> dict:
    return tomllib.loads(text)


HEAD1 = BASE + CLUSTER
HEAD2 = (
    HEAD1.replace('address = "10.99.0.1"', 'address = "10.99.0.2"\nhttp_port = 8081')
    .replace('name = "head1"', 'name = "head2"\nsegment = "10.99.0.0/25"\nlease_ttl = 10')
    .replace("10.98.0.1:2379", "10.98.0.9:2379")  # its nearest member
    .replace("[groups.compute]", '[api]\nlisten = []\n\n[groups.compute]')
)  # fmt: skip


def test_own_settings_may_differ() -> None:
    assert first_difference(parsed(HEAD1), parsed(HEAD2)) is None
    assert rest_differs(HEAD1, HEAD2, 7) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('image = "base"', 'image = "other"'),
            "groups.compute.image differs: 'base' here, 'other' in the cluster's file (revision 7)",
        ),
        (
            (
                'subnet = "10.99.0.0/24"',
                'subnet = "10.99.0.0/24"\npool = "10.99.0.200-10.99.0.210"',
            ),
            "network.pool is in the cluster's file (revision 7), not here",
        ),
        (
            ('[images.other]\nsource = "oci-layout:other"\n', ""),
            "images.other is here, not in the cluster's file (revision 7)",
        ),
        (
            (
                'nodes = "cn[001-002]"',
                'nodes = "cn[001-002]"\nmac = ["52:54:00:00:00:01", "52:54:00:00:00:02"]',
            ),
            "groups.compute.mac is in the cluster's file (revision 7), not here",
        ),
        (
            ('image = "base"', 'image = "base"\n[files."/etc/motd"]\nmode = "0644"'),
            "files is in the cluster's file (revision 7), not here",
        ),
    ],
)
def test_the_first_key_that_differs_is_named(change: tuple[str, str], expected: str) -> None:
    theirs = HEAD2.replace(*change)
    assert theirs != HEAD2
    assert rest_differs(HEAD1, theirs, 7) == expected


def test_values_of_other_types_differ() -> None:
    here, there = parsed("[network]\nlease_time = 5\n"), parsed("[network]\nlease_time = 5.0\n")
    found = first_difference(here, there)
    assert found is not None and (found.path, found.here, found.there) == (
        ("network", "lease_time"), 5, 5.0
    )  # fmt: skip
    assert first_difference({"a": [1, True]}, {"a": [1, 1]}) is not None


def test_keys_are_written_as_in_the_file() -> None:
    here = parsed('[files."/etc/motd"]\nmode = "0644"\n')
    there = parsed('[files."/etc/motd"]\nmode = "0600"\n')
    found = first_difference(here, there)
    assert found is not None and found.render(2) == (
        "files.\"/etc/motd\".mode differs: '0644' here, '0600' in the cluster's file (revision 2)"
    )


def test_own_tables_on_one_side_only_are_no_difference() -> None:
    assert first_difference(parsed('[cluster]\nname = "a"\n[api]\nlisten = []\n'), {}) is None
    found = first_difference({}, parsed("[groups.gpu]\n"))
    assert found is not None and (found.key, found.here, found.there) == (
        "groups",
        ABSENT,
        {"gpu": {}},
    )


def test_a_file_that_is_not_toml() -> None:
    assert rest_differs(HEAD1, "[server", 3) == (
        "the cluster's file (revision 3) is not TOML: Expected ']' at the end of a table "
        "declaration (at end of document)"
    )
    assert rest_differs("a = " + "9" * 5000, HEAD1, 3) == (
        "this node file is not TOML: Exceeds the limit (4300 digits) for integer string "
        "conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit"
    )


def test_keys_and_values_are_shown_printable() -> None:
    found = first_difference({"files": {"/etc/\x1b[2J": 1}}, {"files": {"/etc/\x1b[2J": 2}})
    assert found is not None and found.render(1) == (
        'files."/etc/\\x1b[2J" differs: 1 here, 2 in the cluster\'s file (revision 1)'
    )


def test_combined_takes_own_settings_and_leaves_both_files_alone() -> None:
    own, cluster = parsed(HEAD2), parsed(HEAD1.replace('image = "base"', 'image = "other"'))
    both = combined(own, cluster)
    assert (both["server"], both["api"], both["cluster"]) == (
        own["server"],
        own["api"],
        own["cluster"],
    )
    assert both["groups"]["compute"]["image"] == "other"
    assert cluster["cluster"]["name"] == "head1" and "api" not in cluster
    # an own table this instance leaves out takes its defaults here, not the other's
    assert "api" not in combined(parsed(HEAD1), parsed(HEAD2))


def test_parse_shared_runs_the_cluster_file_with_own_settings(folder: Path) -> None:
    path = folder / "nodes.toml"
    theirs = HEAD1.replace('image = "base"', 'image = "other"')
    config = parse_shared(theirs, HEAD2, path)
    assert config.server.address.exploded == "10.99.0.2" and config.server.http_port == 8081
    assert config.cluster is not None
    assert (config.cluster.name, config.cluster.segment) == ("head2", "10.99.0.0/25")
    assert config.nodes["cn001"].image == "other"
    assert config.minos.kernel == folder / "vmlinuz"  # relative to this instance's file


def test_parse_shared_problems_name_the_lines_of_each_text(folder: Path) -> None:
    path = folder / "nodes.toml"
    theirs = HEAD1.replace('kernel = "vmlinuz"', 'kernel = "gone"')
    own = HEAD2.replace('address = "10.99.0.2"', '\naddress = "10.98.0.2"')
    with pytest.raises(ConfigError) as raised:
        parse_shared(theirs, own, path)
    assert raised.value.render().replace(f"{folder}/", "").splitlines() == [
        "nodes.toml:4: server.address: 10.98.0.2 is outside network.subnet 10.99.0.0/24",
        "nodes.toml:10: minos.kernel: gone does not exist (build the minOS with minos/build.sh)",
    ]


def test_a_reload_that_changes_cluster_is_refused(make_config, tmp_path: Path) -> None:
    """Like [server] and [api], [cluster] is read at start only: a reload says so."""
    from layerpy.config import ReloadRefused
    from layerpy.server import Server, local_backend

    config = make_config()
    state = tmp_path / "state"
    server = Server(config, local_backend(config, state), state_dir=state)
    config.path.write_text(
        config.path.read_text() + '[cluster]\netcd = ["http://127.0.0.1:2379"]\nname = "a"\n'
    )
    with pytest.raises(ReloadRefused) as refused:
        server._read_again()
    assert refused.value.problems == [
        f"{config.path}: [cluster] changed; restart layerpy serve to apply it"
    ]

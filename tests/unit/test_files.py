"""Per-node files: templates with the node's and the cluster's facts, secrets, who gets
what, the revision, and the node file's checks of [files] (issue 13)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from layerpy.cli import main
from layerpy.config import ConfigError, load
from layerpy.files import Deliveries, RenderError, files_for, revision

from nodefile import BOOT_SECTIONS, write_boot_files

CLUSTER = """\
[server]
interface = "br0"
address = "10.99.0.1"
state_dir = "state"

[network]
subnet = "10.99.0.0/24"

{boot}

[images.slurm]
source = "oci-layout:slurm-oci:v1"

[groups.compute]
nodes = "cn[001-004]"
ip = "10.99.0.[11-14]"
image = "slurm"
vars = {{ partition = "batch", cpus = 2 }}

[nodes.cn004]
vars = {{ cpus = 8 }}

[nodes.login]
ip = "10.99.0.5"

[files."/etc/slurm/slurm.conf"]
template = "slurm.conf.j2"
owner = "slurm"
apply = "systemctl restart slurmd"
images = ["slurm"]

[files."/etc/hosts"]
template = "hosts.j2"

[files."/etc/munge/munge.key"]
secret = "munge.key"
owner = "munge:munge"
groups = ["compute"]

[files."/etc/motd"]
template = "motd.j2"
nodes = "cn001"
"""

TEMPLATES = {
    "slurm.conf.j2": "ClusterName=lab\nNodeName={{ groups.compute.hosts }} CPUs={{ cpus }}\n"
    "PartitionName={{ partition }} Nodes={{ groups.compute.names | hostlist }}\n"
    "# this is {{ node.name }} at {{ node.ip }}\n",
    "hosts.j2": "{% for n in nodes %}{{ n.ip }} {{ n.name }}\n{% endfor %}",
    "motd.j2": "Welcome to {{ node.name }} ({{ node.group }}), served by {{ server.address }}\n",
}


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    write_boot_files(tmp_path)
    for name, text in TEMPLATES.items():
        (tmp_path / name).write_text(text)
    key = tmp_path / "munge.key"
    key.write_bytes(b"\x01\x02secret-munge-key\x00" * 4)
    key.chmod(0o600)
    path = tmp_path / "nodes.toml"
    path.write_text(CLUSTER.format(boot=BOOT_SECTIONS))
    return path


def test_templates_see_the_node_and_the_cluster(cluster) -> None:
    config = load(cluster)
    cn004 = {f.path: f for f in files_for(config, "cn004")}
    assert list(cn004) == ["/etc/hosts", "/etc/munge/munge.key", "/etc/slurm/slurm.conf"]
    assert cn004["/etc/slurm/slurm.conf"].content.decode() == (
        "ClusterName=lab\nNodeName=cn[001-004] CPUs=8\nPartitionName=batch Nodes=cn[001-004]\n"
        "# this is cn004 at 10.99.0.14\n"
    )
    hosts = cn004["/etc/hosts"].content.decode().splitlines()
    assert hosts == ["10.99.0.11 cn001", "10.99.0.12 cn002", "10.99.0.13 cn003",
                     "10.99.0.14 cn004", "10.99.0.5 login"]  # fmt: skip
    slurm = cn004["/etc/slurm/slurm.conf"]
    assert (slurm.mode, slurm.owner, slurm.apply) == (
        0o644,
        "slurm:slurm",
        "systemctl restart slurmd",
    )
    key = cn004["/etc/munge/munge.key"]
    assert key.secret and key.mode == 0o400 and key.owner == "munge:munge"
    assert key.content == b"\x01\x02secret-munge-key\x00" * 4


def test_each_node_gets_what_its_image_group_and_name_select(cluster) -> None:
    config = load(cluster)
    assert [f.path for f in files_for(config, "login")] == ["/etc/hosts"]
    assert "/etc/motd" in [f.path for f in files_for(config, "cn001")]
    assert "/etc/motd" not in [f.path for f in files_for(config, "cn002")]
    motd = next(f for f in files_for(config, "cn001") if f.path == "/etc/motd")
    assert motd.content == b"Welcome to cn001 (compute), served by 10.99.0.1\n"


def test_the_revision_follows_any_change(cluster) -> None:
    before = {n: revision(files_for(load(cluster), n)) for n in ("cn001", "cn004", "login")}
    assert len(set(before.values())) == 3
    assert before["cn001"] == revision(files_for(load(cluster), "cn001"))  # stable
    cluster.write_text(cluster.read_text().replace("cpus = 8", "cpus = 16"))
    after = {n: revision(files_for(load(cluster), n)) for n in ("cn001", "cn004", "login")}
    assert after["cn004"] != before["cn004"] and after["cn001"] == before["cn001"]
    (cluster.parent / "munge.key").write_bytes(b"another key")
    assert revision(files_for(load(cluster), "cn001")) != before["cn001"]
    assert revision(files_for(load(cluster), "login")) == before["login"]


def test_a_template_that_fails_for_a_node_refuses_the_node_file(cluster) -> None:
    """Made for every node at load: a typo is a refused reload, not a broken node later."""
    (cluster.parent / "motd.j2").write_text("line one\n{{ node.name }} {{ no_such_var }}\n")
    with pytest.raises(ConfigError) as refused:
        load(cluster)
    assert [p.message for p in refused.value.problems] == [
        f"/etc/motd for cn001: 'no_such_var' is undefined ({cluster.parent / 'motd.j2'})"
    ]
    assert refused.value.problems[0].key == 'files."/etc/motd"'


def test_a_secret_gone_since_the_load_is_a_refused_render(cluster) -> None:
    config = load(cluster)
    (cluster.parent / "munge.key").unlink()
    with pytest.raises(RenderError, match=r"/etc/munge/munge.key: cannot read .*munge.key"):
        files_for(config, "cn001")


def test_deliveries_follow_the_image_the_node_is_told_to_run(cluster) -> None:
    config = load(cluster)
    deliveries = Deliveries()
    running = deliveries.spec(config, "cn001", "slurm")
    assert [f.path for f in running.files] == [
        "/etc/hosts", "/etc/motd", "/etc/munge/munge.key", "/etc/slurm/slurm.conf",
    ]  # fmt: skip
    assert running.revision == revision(files_for(config, "cn001"))
    assert [f.path for f in deliveries.spec(config, "cn001", None).files] == [
        "/etc/hosts", "/etc/motd", "/etc/munge/munge.key",
    ]  # fmt: skip
    key = next(f for f in running.files if f.path == "/etc/munge/munge.key")
    assert (key.mode, key.owner, key.size) == (0o400, "munge:munge", 76)
    assert deliveries.content(running, key.digest) == b"\x01\x02secret-munge-key\x00" * 4
    login = deliveries.spec(config, "login", None)
    assert deliveries.content(login, key.digest) is None  # not one of login's files
    assert deliveries.spec(config, "cn001", "slurm") is running  # made once per node file


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('[files."/etc/motd"]', '[files."etc/motd"]'),
            "'etc/motd' must be an absolute, normalised path, like /etc/hosts",
        ),
        (
            ('[files."/etc/motd"]', '[files."/proc/x"]'),
            "/proc/x is under /proc, /sys, /dev, /run, /tmp, which the node's runtime mounts",
        ),
        (('groups = ["compute"]', 'groups = ["gpu"]'), "names no such group: gpu"),
        (('nodes = "cn001"', 'nodes = "cn009"'), "names no such node: cn009"),
        (
            ('owner = "munge:munge"', 'owner = "munge:munge"\nmode = "0644"'),
            "0644 lets others read a secret on the node (0400 or 0600)",
        ),
        (
            ('secret = "munge.key"', 'secret = "munge.key"\ntemplate = "hosts.j2"'),
            "needs a template or a secret (one of them)",
        ),
        (
            ('owner = "slurm"', 'owner = "slurm; rm -rf /"'),
            "'slurm; rm -rf /' must be user or user:group (names or numbers)",
        ),
        (
            (
                'source = "oci-layout:slurm-oci:v1"',
                'source = "oci-layout:slurm-oci:v1"\npersist = ["/etc/slurm"]',
            ),
            "meets /etc/slurm, which image slurm keeps across image "
            "changes (persist): the node's own copy would hide it",
        ),
        (
            (
                'source = "oci-layout:slurm-oci:v1"',
                'source = "oci-layout:slurm-oci:v1"\npersist = ["/var/lib", "/var/lib/munge"]',
            ),
            "/var/lib/munge is inside /var/lib, which image slurm keeps: a node keeps one store "
            "for all its images; name the outer one only",
        ),
        (
            (
                'source = "oci-layout:slurm-oci:v1"',
                'source = "oci-layout:slurm-oci:v1"\npersist = ["/tmp/state"]',
            ),
            "/tmp/state is under /proc, /sys, /dev, /run, /tmp, which the node's runtime mounts",
        ),
    ],
    ids=[
        "relative",
        "runtime",
        "group",
        "node",
        "secret mode",
        "both",
        "owner",
        "persisted",
        "nested persist",
        "persist in tmp",
    ],
)
def test_the_node_file_refuses_bad_files(cluster, change, expected) -> None:
    cluster.write_text(cluster.read_text().replace(*change, 1))
    with pytest.raises(ConfigError) as raised:
        load(cluster)
    assert [p.message for p in raised.value.problems] == [expected]


def test_a_world_readable_secret_or_a_broken_template_is_refused(cluster) -> None:
    (cluster.parent / "munge.key").chmod(0o644)
    (cluster.parent / "hosts.j2").write_text("{% for n in nodes %}\n{{ n.name }\n")
    with pytest.raises(ConfigError) as raised:
        load(cluster)
    messages = [p.message for p in raised.value.problems]
    assert messages == [
        f"{cluster.parent}/hosts.j2 line 2: unexpected '}}'",
        f"{cluster.parent}/munge.key is readable by every user of this host: chmod o-r it",
    ]


def test_render_lists_and_shows_but_never_prints_a_secret(cluster) -> None:
    runner = CliRunner()
    listed = runner.invoke(main, ["render", "cn001", "-c", str(cluster)])
    assert listed.exit_code == 0, listed.output
    assert listed.output.startswith("cn001: revision ") and "4 file(s)" in listed.output
    assert "/etc/munge/munge.key  0400 munge:munge  76 B  sha256:" in listed.output
    shown = runner.invoke(main, ["render", "cn001", "/etc/slurm/slurm.conf", "-c", str(cluster)])
    assert "NodeName=cn[001-004] CPUs=2" in shown.output
    secret = runner.invoke(main, ["render", "cn001", "/etc/munge/munge.key", "-c", str(cluster)])
    assert (
        secret.output.startswith("(secret: 76 bytes from ") and "secret-munge" not in secret.output
    )
    missing = runner.invoke(main, ["render", "login", "/etc/munge/munge.key", "-c", str(cluster)])
    assert missing.exit_code == 2 and "login gets no /etc/munge/munge.key" in missing.output


def test_vars_must_be_a_table(cluster) -> None:
    cluster.write_text(cluster.read_text().replace("vars = { cpus = 8 }", 'vars = "cpus=8"'))
    with pytest.raises(ConfigError) as raised:
        load(cluster)
    assert [p.message for p in raised.value.problems] == ["must be a table, not a string"]

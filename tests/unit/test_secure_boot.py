"""The Secure Boot path (issue 28): the node file's ``secure_boot``, what DHCP offers such a
node (Debian's signed shim by TFTP, never iPXE), its GRUB config (the iPXE script's command
line, only to its own address), the agent reading SecureBoot from efivarfs, and the store
showing a node that reports it off."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_boot_policy import answer, make_service, with_discovery

from layerpy import boot
from layerpy import stats as stats_module
from layerpy.agent import firmware
from layerpy.boot import GRUB_CONFIG, Refused, SignedOnly, grub_words, phase_of
from layerpy.census import SECURE_BOOT
from layerpy.config import ConfigError, load
from layerpy.model import Phase
from layerpy.nodes import reports
from layerpy.proto import dhcp
from layerpy.proto.agent import PROTOCOL, Cmdline, Report

from dhcp_requests import ARM64, BIOS, HTTP_BOOT, IPXE, STRANGER, UEFI, request
from stores import local_policy, local_store

SECURE = "\n[nodes.cn001]\nsecure_boot = true\n"  # cn001 (MAC ...:11) of the test file's group


@pytest.fixture(autouse=True)
def fresh_log_windows() -> Iterator[None]:
    """Refusals are logged a few a minute (boot.quiet): these tests' own must not use up
    the window that the next test module counts on."""
    yield
    boot.quiet.end("unbootable firmware")


def secure_config(make_config):
    return make_config(secure=SECURE)


# -- the node file --------------------------------------------------------------------------


def test_secure_boot_is_a_group_and_node_key(make_config) -> None:
    config = make_config()
    assert not any(node.secure_boot for node in config.nodes.values())
    text = config.path.read_text().replace(
        "[groups.compute]\n", "[groups.compute]\nsecure_boot = true\n"
    )
    config.path.write_text(text + "\n[nodes.cn002]\nsecure_boot = false\n")
    nodes = load(config.path).nodes
    assert (nodes["cn001"].secure_boot, nodes["cn002"].secure_boot) == (True, False)


def test_secure_boot_must_be_true_or_false(make_config) -> None:
    config = make_config()
    config.path.write_text(config.path.read_text() + '\n[nodes.cn001]\nsecure_boot = "yes"\n')
    with pytest.raises(ConfigError, match=r"nodes\.cn001\.secure_boot"):
        load(config.path)


def test_secure_boot_needs_the_signed_loaders(make_config, tmp_path: Path) -> None:
    config = secure_config(make_config)
    for name in ("shimx64.efi", "grubx64.efi"):
        (tmp_path / "signed" / name).unlink()
    with pytest.raises(ConfigError) as refused:
        load(config.path)
    message = str(refused.value)
    assert ".secure_boot: cn001 boots by the signed path" in message
    assert "shimx64.efi and grubx64.efi" in message and "vm-lab/signed-loaders.sh" in message
    config.path.write_text(config.path.read_text().replace(SECURE, ""))
    assert load(config.path).signed.directory == tmp_path / "signed"  # no node needs them


# -- what DHCP offers -----------------------------------------------------------------------


def test_a_secure_boot_node_is_offered_shim_by_tftp(make_config) -> None:
    offer = answer(make_service(secure_config(make_config)), request(dhcp.DISCOVER, **UEFI))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"shimx64.efi"
    assert str(offer.siaddr) == "10.99.0.1"
    assert offer.options[dhcp.OPT_VENDOR_CLASS] == b"PXEClient"


def test_other_nodes_keep_ipxe(make_config) -> None:
    offer = answer(make_service(make_config()), request(dhcp.DISCOVER, **UEFI))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"snponly.efi"


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (IPXE, "iPXE asks, but the node has secure_boot = true: it gets the signed path only"),
        (BIOS, "firmware bios: no signed loader runs on it (secure_boot needs UEFI)"),
        (HTTP_BOOT, "firmware uefi-http: UEFI HTTP boot, but Debian 12's signed GRUB, started"),
        (ARM64, "firmware uefi-arm64: no shimaa64.efi and grubaa64.efi in "),
    ],
)
def test_a_secure_boot_node_gets_nothing_unsigned(
    make_config, options, why, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service(secure_config(make_config))
    with caplog.at_level(logging.WARNING, "layerpy.dhcp"):
        assert answer(service, request(dhcp.DISCOVER, **options)) is None
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith(
        f"cn001: not answered: {why}"
    )


def test_firmware_without_an_ipxe_binary_gets_the_signed_path(make_config, tmp_path) -> None:
    """arm64 has no [ipxe] binary unless the file names one: Debian's signed arm64 shim
    and GRUB boot it where they are (no secure_boot needed)."""
    make_config()
    for name in ("shimaa64.efi", "grubaa64.efi"):
        (tmp_path / "signed" / name).write_bytes(b"MZ")
    offer = answer(make_service(make_config()), request(dhcp.DISCOVER, **ARM64))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"shimaa64.efi"
    # a machine no node claims gets no GRUB: its config is a node's
    discovery = make_service(with_discovery(make_config))
    assert answer(discovery, request(dhcp.DISCOVER, STRANGER, **ARM64)) is None


def test_no_ipxe_script_for_a_secure_boot_node(make_config) -> None:
    policy = local_policy(secure_config(make_config))
    with pytest.raises(SignedOnly):
        asyncio.run(policy.script("cn001", "10.99.0.11"))
    assert asyncio.run(policy.script("cn002", "10.99.0.12")) is not None


# -- GRUB's config, and what TFTP serves of the signed path -----------------------------------


def booting(policy, *names: str) -> None:
    """The nodes' UEFI firmware asked DHCP: their boots wait for GRUB's config."""
    for name in names:
        policy.nodes.saw_boot_request(policy.nodes.nodes[name], "uefi")


def _cmdline(text: str, prefix: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return line.removeprefix(prefix)


def test_grub_config_carries_the_ipxe_scripts_command_line(make_config) -> None:
    config = secure_config(make_config)
    policy = local_policy(config)
    booting(policy, "cn001", "cn002")
    grub = asyncio.run(policy.grub_config("10.99.0.11")).splitlines()
    assert grub[0] == "echo 'layerpy: booting cn001 into the minOS'"
    assert grub[2:] == ["initrd (tftp,10.99.0.1)/minos/initrd", "boot"]
    words = re.findall(r"'([^']*)'", _cmdline(grub[1], "linux (tftp,10.99.0.1)/minos/kernel "))
    line = Cmdline.parse(" ".join(words))
    assert (line.node, line.servers, line.bootif) == (
        "cn001",
        ("http://10.99.0.1:8080",),
        "52:54:00:99:00:11",
    )
    assert words[0] == "console=ttyS0" and "initrd=minos" not in words  # iPXE's only
    assert policy.nodes.holds_token("cn001", line.token)  # a boot token was issued for it
    grub2 = asyncio.run(policy.grub_config("10.99.0.12")).splitlines()[1]
    script = asyncio.run(policy.script("cn002", "10.99.0.12"))
    ipxe = _cmdline(script, "kernel http://10.99.0.1:8080/minos/kernel initrd=minos ").split()
    same = [word.strip("'") for word in grub2.split()[2:]]

    def untokened(words: list[str]) -> list[str]:
        return [w for w in words if not w.startswith("layerpy.token=")]

    assert untokened(same) == untokened(ipxe) and len(same) == len(ipxe) > 4


def test_grub_words_are_quoted_for_grub() -> None:
    assert grub_words("a=1  b=$x c=it's") == "'a=1' 'b=$x' 'c=it'\\''s'"


def test_the_grub_config_goes_only_to_a_node_at_its_own_address(make_config) -> None:
    policy = local_policy(secure_config(make_config))
    booting(policy, "cn001")
    with pytest.raises(Refused):
        asyncio.run(policy.loader_file(GRUB_CONFIG, "10.99.0.99"))
    mine = asyncio.run(policy.loader_file("/" + GRUB_CONFIG, "10.99.0.11"))
    assert isinstance(mine, bytes) and b" 'layerpy.node=cn001' " in mine
    again = asyncio.run(policy.loader_file(GRUB_CONFIG, "10.99.0.11"))
    assert again == mine  # GRUB tests for the file, then reads it: one token a boot


def test_a_forged_grub_config_read_issues_no_token(make_config) -> None:
    """TFTP's source address is easily forged: a read of the GRUB config from a node's
    address while its boot waits for none (not booting, or its script already went out)
    is refused, and neither ends the node's token nor starts a boot."""
    policy = local_policy(make_config())
    node = policy.nodes.nodes["cn001"]
    with pytest.raises(Refused, match="waits for no command line"):
        asyncio.run(policy.grub_config("10.99.0.11"))  # never booted
    assert node.boot is None
    script = asyncio.run(policy.script("cn001", "10.99.0.11"))  # it boots by iPXE
    token = Cmdline.parse(
        _cmdline(script, "kernel http://10.99.0.1:8080/minos/kernel initrd=minos ")
    ).token
    boots = node.boots
    with pytest.raises(Refused):
        asyncio.run(policy.loader_file(GRUB_CONFIG, "10.99.0.11"))
    assert policy.nodes.holds_token("cn001", token) and node.boots == boots


def test_tftp_names_of_the_signed_path(make_config, tmp_path: Path) -> None:
    policy = local_policy(make_config())

    def look(name: str):
        return asyncio.run(policy.loader_file(name, "10.99.0.11"))

    assert look("shimx64.efi") == tmp_path / "signed" / "shimx64.efi"
    assert look("/grubx64.efi") == tmp_path / "signed" / "grubx64.efi"
    assert look("minos/kernel") == tmp_path / "vmlinuz"
    assert look("/minos/initrd") == tmp_path / "initrd"
    assert look("snponly.efi") is None and look("grub/x86_64-efi/grub.cfg") is None
    assert look("signed/shimx64.efi") is None  # only the names shim and GRUB ask for
    assert [phase_of(n) for n in ("/minos/kernel", "minos/initrd", "shimx64.efi")] == [
        Phase.KERNEL, Phase.INITRD, Phase.TFTP,
    ]  # fmt: skip


# -- the agent's word, and the store's ------------------------------------------------------


def efi_dir(tmp_path: Path, value: bytes | None, mounted: bool = True) -> str:
    """A /sys/firmware/efi with efivarfs as the kernel shows it: SecureBoot's 4 bytes of
    attributes (NV, BS, RT: 0x06) and its data byte."""
    efi = tmp_path / "efi"
    (efi / "efivars").mkdir(parents=True)
    if mounted:
        (efi / "efivars" / "BootCurrent-8be4df61-93ca-11d2-aa0d-00e098032b8c").write_bytes(
            b"\x06\x00\x00\x00\x01\x00"
        )
    if value is not None:
        (efi / "efivars" / firmware.SECURE_BOOT).write_bytes(b"\x06\x00\x00\x00" + value)
    return str(efi)


@pytest.mark.parametrize(
    ("value", "mounted", "said"),
    [
        (b"\x01", True, True),
        (b"\x00", True, False),
        (None, True, False),  # firmware without Secure Boot at all
        (None, False, None),  # efivarfs not mounted: nothing can be said
        (b"\x02", True, None),
        (b"\x01\x00", True, None),
    ],
)
def test_agent_reads_secure_boot_from_efivars(tmp_path, value, mounted, said) -> None:
    assert firmware.secure_boot(efi_dir(tmp_path, value, mounted)) is said


def test_a_bios_machine_has_secure_boot_off(tmp_path) -> None:
    assert firmware.secure_boot(str(tmp_path / "no-such-efi")) is False


def test_the_report_carries_it_and_an_older_agent_may_leave_it_out() -> None:
    base = {"node": "cn001", "token": "t", "mac": "52:54:00:99:00:11", "ip": "10.99.0.11",
            "boot_id": "b1", "seq": 1, "event": "hello"}  # fmt: skip
    assert Report.from_json(base | {"protocol": PROTOCOL, "secure_boot": True}).secure_boot is True
    assert Report.from_json(base | {"protocol": "1.2"}).secure_boot is None
    with pytest.raises(ValueError, match=r"report\.secure_boot must be true or false"):
        Report.from_json(base | {"protocol": PROTOCOL, "secure_boot": "on"})


def _report(store, name: str, secure_boot: bool | None) -> None:
    node = store.nodes[name]
    token = store.issue_token(node)
    payload = {"node": name, "token": token, "mac": node.config.mac, "ip": str(node.config.ip),
               "boot_id": "b1", "seq": 1, "event": "hello", "protocol": PROTOCOL,
               "secure_boot": secure_boot}  # fmt: skip
    effects, ack = reports.admit(store, payload)
    assert ack == reports.Ack(name)
    store.apply(effects)


def test_a_secure_boot_node_reporting_it_off_is_a_problem(make_config) -> None:
    store = local_store(secure_config(make_config))
    _report(store, "cn001", False)
    _report(store, "cn002", False)  # no secure_boot wanted: off is no problem
    cn001, cn002 = store.nodes["cn001"], store.nodes["cn002"]
    assert cn001.problem == reports.SECURE_BOOT_OFF and cn001.as_json()["secure_boot"] is False
    assert cn002.problem is None
    _report(store, "cn001", True)
    assert cn001.problem is None and cn001.secure_boot is True


def test_metrics_count_secure_boot() -> None:
    """What census.count hands /metrics, rendered by the same collector."""
    census = stats_module.Census(
        secure_boot={SECURE_BOOT[True]: 3, SECURE_BOOT[None]: 1, "missing": 2}
    )
    states = stats_module.NodeStates(count=None)  # type: ignore[arg-type]
    states.census = census
    samples = {
        (s.name, tuple(s.labels.values())): s.value
        for family in states.collect()
        for s in family.samples
    }
    assert samples[("layerpy_nodes_secure_boot", ("on",))] == 3
    assert samples[("layerpy_nodes_secure_boot", ("off",))] == 0
    assert samples[("layerpy_nodes_secure_boot", ("unknown",))] == 1
    assert samples[("layerpy_nodes_secure_boot_missing", ())] == 2

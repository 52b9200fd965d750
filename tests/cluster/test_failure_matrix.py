"""The failure matrix of issue 27, point 4: three `layerpy serve` instances on a 3-member etcd
and one boot segment, three simulated nodes (a real agent running a real busybox container,
udhcpc keeping the node's address, a QEMU behind a lab BMC that logs every power command),
and three Slurm nodes (the same agent running the Slurm lab's image: slurmd and munged,
slurmctld beside them on the segment), all in namespaces (tests/ha_rig.py). Each case
breaks one thing and checks what the nodes and the operator see. One rig per module; every
test leaves it whole again. Without Slurm's packages the rig has no Slurm nodes and the
rolling upgrade is skipped.

Measured times are printed (run with -s): "measured: …".
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ha_rig import CONTROLLER, SPARE, Capture, Node, Rig, Server, tail, wait_for

from etcd import EtcdCluster
from netns import Netns, unique_name
from slurm_controller import Controller, held_job

pytestmark = pytest.mark.netns

TAKEOVER = 10.0  # seconds: a dead instance's nodes owned by another (issue 27)
HELD = "lost etcd"  # what an instance logs when its fence closes (docs/ha.md)
BACK = "acting on the nodes this instance owns"  # …and when its lease is fresh again
# the Slurm nodes need the image build (mmdebstrap, or its cache) and the controller's daemons
SLURM = all(map(shutil.which, ("mmdebstrap", "slurmctld", "munged", "sbatch")))
NO_SLURM = "needs mmdebstrap, slurmctld, munge and slurm-client (vm-lab/setup.sh installs them)"


@pytest.fixture(scope="module")
def rig(etcd_cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    built = Rig(etcd_cluster, tmp_path_factory.mktemp("matrix", numbered=True), servers=3,
                nodes=3, prefix=f"/{unique_name('matrix')}", slurm=3 if SLURM else 0)  # fmt: skip
    try:
        built.start()
        yield built
    finally:
        built.close()


@pytest.fixture(autouse=True)
def whole(rig: Rig, etcd_cluster: EtcdCluster) -> Iterator[Rig]:
    """Each test starts with every member, instance and agent up, and leaves them so."""
    yield rig
    etcd_cluster.heal()
    for server in rig.servers:
        if server.dead():
            server.start()
    for node in rig.nodes:
        if node.agent is not None:
            node.agent.send_signal(signal.SIGCONT)
        node.mark_bmc()


def heard(rig: Rig, node: Node) -> float:
    """The node's last report as the instance that heard it has it (heartbeats are each
    instance's own: they never go through etcd)."""
    return max((s.node(node.name).get("last_report") or 0.0 for s in rig.servers if not s.dead()),
               default=0.0)  # fmt: skip


def reports_advance(rig: Rig, what: str) -> None:
    """Every node's reports reach an instance: a report newer than the last one heard."""
    for node in rig.nodes:
        before = heard(rig, node)
        wait_for(lambda n=node, t=before: heard(rig, n) > t, 20,
                 f"{what}: a new report of {node.name} heard by any instance",
                 node.agent_log, *(s.log for s in rig.servers))  # fmt: skip


def boots(rig: Rig, server: Server) -> None:
    """The spare node's boot script from that instance, fetched from the spare's address
    (a fetch is a boot: it gives the node a new token, so never for a node whose agent
    runs); its token proves it is the node's own script."""
    url = f"{server.url}/boot/{SPARE}.ipxe"
    result = rig.spare.run("curl", "-s", "--max-time", "10", "-w", "\n%{http_code}", url,
                           check=False)  # fmt: skip
    body, _, code = result.stdout.rpartition("\n")
    assert code == "200" and "layerpy.token=" in body, (
        f"{SPARE}'s boot script from {server.name}: HTTP {code or 'none'}\n{body[-500:]}"
    )


def dhcp_renews(nodes: list[Node], what: str) -> None:
    """udhcpc renews each node's address (lease 20 s: a renewal each 10 s, all waited for
    at once): the same one as ever."""
    counts = [len(node.addresses()) for node in nodes]
    for node, count in zip(nodes, counts, strict=True):
        wait_for(lambda n=node, c=count: len(n.addresses()) > c, 30,
                 f"{what}: {node.name}'s DHCP renewal", node.dhcp_log,
                 *(s.log for s in node.rig.servers))  # fmt: skip
        assert set(node.addresses()) == {node.ip}, f"{node.name}'s addresses: {node.addresses()}"


def live(server: Server) -> bool:
    """The instance is in etcd's list of live instances, as it sees it itself."""
    instances = server.cluster().get("instances", [])
    return any(i["name"] == server.name and i["alive"] for i in instances)


def roll_step(node: Node, image: str) -> str:
    """The agent's last line about the image (pulling, updating, active in …), or ""."""
    lines = node.agent_log.read_text(errors="replace").splitlines()
    return next((line for line in reversed(lines) if f"image {image} " in line), "")


def other_image(node: Node) -> str:
    """The image the node does not run now (its agent's last "active in" line says which)."""
    lines = node.agent_log.read_text(errors="replace").splitlines()
    running = next(line for line in reversed(lines) if " active in " in line)
    return "one" if "image two " in running else "two"


def set_image(rig: Rig, server: Server, image: str) -> None:
    """`layerpy reload` on that instance with every node's image changed in the file."""
    rig.shared_text = rig.shared_text.replace('image = "one"', f'image = "{image}"').replace(
        'image = "two"', f'image = "{image}"'
    )
    reload(rig, server)


def reload(rig: Rig, server: Server) -> None:
    server.file.write_text(rig.own_tables(server) + rig.shared_text)
    result = server.cli("reload")
    assert result.returncode == 0, (
        f"layerpy reload on {server.name}: {result.stdout}{result.stderr}"
    )


# --- 1. kill -9 the owner in the middle of an image roll -------------------------------


def test_owner_killed_during_a_roll_another_takes_over_and_the_roll_completes(rig: Rig) -> None:
    victim = rig.owner_of(rig.nodes[0])
    orphans = victim.owns()
    survivor = next(server for server in rig.servers if server is not victim)
    starts = {node.name: node.starts() for node in rig.nodes}
    for node in rig.nodes:  # a slow link: each pull of image two takes seconds
        rig.throttle(node, "1mbit")
    try:
        set_image(rig, survivor, "two")
        first = next(node for node in rig.nodes if node.name == orphans[0])
        wait_for(lambda: "image two" in first.agent_log.read_text(), 20,
                 f"{first.name} pulling image two (the roll under way)", first.agent_log,
                 victim.log, survivor.log)  # fmt: skip
        states = {node.name: roll_step(node, "two") for node in rig.nodes}
        victim.kill()
        killed = time.monotonic()
        others = {server.name for server in rig.servers if server is not victim}
        took = wait_for(lambda: all(rig.owners().get(name) in others for name in orphans), 30,
                        f"{orphans} (of {victim.name}, killed) owned by {others}",
                        *(s.log for s in rig.servers), seen=rig.owners)  # fmt: skip
        print(f"\nmeasured: take-over after kill -9 in a roll: {took:.1f} s "
              f"({len(orphans)} nodes; each node's roll at the kill: {states})")  # fmt: skip
        assert took < TAKEOVER, f"take-over took {took:.1f} s (limit {TAKEOVER:g} s)"
        assert any(" active in " not in state for state in states.values()), (
            f"the roll was over before the kill: {states}"
        )
        for node in rig.nodes:
            # the agent's own word first: the API names the image the file wants beside the
            # state the agent last reported, "active" still for image one until it reports
            wait_for(lambda node=node: " active in " in roll_step(node, "two"), 120,
                     f"{node.name}'s agent starting image two", node.agent_log,
                     survivor.log)  # fmt: skip
            wait_for(lambda node=node: rig.image_state(node, survivor) == ("two", "active"), 60,
                     f"{node.name} running image two, as {survivor.name} has it", node.agent_log,
                     survivor.log, seen=lambda node=node: rig.image_state(node, survivor))  # fmt: skip
        print(f"measured: roll complete {time.monotonic() - killed:.1f} s after the kill")
    finally:
        for node in rig.nodes:
            rig.throttle(node, None)
    after = {node.name: node.starts() for node in rig.nodes}
    assert all(after[name] == starts[name] + 1 for name in starts), (
        f"container starts per node before the roll {starts}, after {after}: "
        "each node must start its new container exactly once"
    )


# --- 2. an instance cut from etcd, not from its nodes ----------------------------------


def test_an_instance_cut_from_etcd_stops_acting_and_no_power_command_is_sent_twice(
    rig: Rig, etcd_cluster: EtcdCluster
) -> None:
    node = rig.nodes[1]
    cut = rig.owner_of(node)
    node.mark_bmc()
    mark = cut.log_size()
    cut.ns.cut()
    try:
        wait_for(lambda: HELD in cut.log_text(mark), 10, f"{cut.name} saying it holds ({HELD!r})",
                 cut.log)  # fmt: skip
        # the node hangs: its agent stops reporting (its container runs on); it needs a cycle
        assert node.agent is not None
        node.agent.send_signal(signal.SIGSTOP)
        wait_for(node.power_commands, 90,
                 f"a power command to {node.name}'s BMC (it hangs; its owner {cut.name} is cut)",
                 node.bmc_log, *(s.log for s in rig.servers))  # fmt: skip
        owners = rig.owners()
        assert owners.get(node.name) not in (None, cut.name), (
            f"{node.name} was cycled while owned by {owners.get(node.name)} ({cut.name} cut)"
        )
    finally:
        cut.ns.restore()
        if node.agent is not None:
            node.agent.send_signal(signal.SIGCONT)
    # the cut instance back: it learns who owns the node now, and acts on nothing of it
    wait_for(lambda: BACK in cut.log_text(mark).split(HELD)[-1], 30,
             f"{cut.name} fresh again ({BACK!r} after {HELD!r})", cut.log)  # fmt: skip
    wait_for(lambda: cut.cluster().get("source") == "etcd" and rig.owners() == {
        n: i["name"] for i in cut.cluster()["instances"] for n in i["nodes"]},
        20, f"{cut.name} seeing the owners as etcd has them", cut.log)  # fmt: skip
    reports_advance(rig, "after the cut")
    commands = node.power_commands()
    assert len(commands) == 1, (
        f"{node.name}'s BMC carried out {commands}: one decision (cycle the hung node) must be "
        f"one command, by whichever instance owned it\n{tail(node.bmc_log)}"
    )


# --- 3. one etcd member lost ------------------------------------------------------------


def test_losing_one_etcd_member_changes_nothing_visible(
    rig: Rig, etcd_cluster: EtcdCluster
) -> None:
    marks = {server.name: server.log_size() for server in rig.servers}
    leader = etcd_cluster.leader()
    leader.kill()
    started = time.monotonic()
    for server in rig.servers:
        boots(rig, server)
    reports_advance(rig, f"etcd member {leader.name} killed")
    rig.shared_text = rig.shared_text.replace("lease_time = 20", "lease_time = 21")
    reload(rig, rig.servers[1])  # two-phase: it returns once every instance accepted it
    # an action: cn003's image changed through its owner's API, and carried out
    node = rig.nodes[2]
    before = node.starts()
    image = other_image(node)
    code, text = rig.owner_of(node).post("/api/v1/image", {"nodes": node.name, "image": image})
    assert code == 200, f"POST /api/v1/image: {code} {text}"
    wait_for(lambda: node.starts() == before + 1, 60, f"{node.name} switching image",
             node.agent_log)  # fmt: skip
    for server in rig.servers:
        shown = server.cli("cluster")
        assert shown.returncode == 0 and "error" not in shown.stdout.lower(), (
            f"layerpy cluster on {server.name} with one member down:\n{shown.stdout}{shown.stderr}"
        )
        assert server.cluster().get("source") == "etcd", server.cluster()
    for server in rig.servers:
        assert HELD not in server.log_text(marks[server.name]), (
            f"{server.name} held:\n{tail(server.log)}"
        )
    print(
        f"\nmeasured: one member ({leader.name}, leader) down, all checks in "
        f"{time.monotonic() - started:.1f} s"
    )
    leader.start()
    etcd_cluster.wait_healthy()


# --- 4. etcd quorum lost -----------------------------------------------------------------


def test_without_quorum_boots_and_reports_go_on_actions_wait(
    rig: Rig, etcd_cluster: EtcdCluster
) -> None:
    node = rig.nodes[0]
    owner = rig.owner_of(node)
    marks = {server.name: server.log_size() for server in rig.servers}
    lost = etcd_cluster.members[:2]
    for member in lost:
        member.kill()
    started = time.monotonic()
    for server in rig.servers:
        wait_for(lambda s=server: HELD in s.log_text(marks[s.name]), 15,
                 f"{server.name} saying it holds ({HELD!r})", server.log)  # fmt: skip
    held = time.monotonic() - started
    before, image = node.starts(), other_image(node)
    code, text = owner.post("/api/v1/image", {"nodes": node.name, "image": image})
    assert code in (200, 503), f"an action without quorum: {code} {text}"
    reports_advance(rig, "no quorum")  # (time for the owner to act, if it would)
    assert node.starts() == before, f"{node.name} switched image without quorum"
    for server in rig.servers:
        boots(rig, server)
    dhcp_renews(rig.nodes, "no quorum")
    assert node.starts() == before, f"{node.name} switched image without quorum"
    for member in lost:
        member.start()
    etcd_cluster.wait_healthy()
    back = time.monotonic()
    for server in rig.servers:
        wait_for(lambda s=server: BACK in s.log_text(marks[s.name]).split(HELD)[-1], 30,
                 f"{server.name} acting again ({BACK!r})", server.log)  # fmt: skip
    if code != 200:  # refused while held: asked again now
        code, text = owner.post("/api/v1/image", {"nodes": node.name, "image": image})
        assert code == 200, f"POST /api/v1/image after quorum: {code} {text}"
    wait_for(lambda: node.starts() == before + 1, 60,
             f"{node.name}'s image switch carried out after quorum is back", node.agent_log)  # fmt: skip
    print(
        f"\nmeasured: held {held:.1f} s after quorum lost; acting again "
        f"{time.monotonic() - back:.1f} s after it returned"
    )


# --- 5. rolling upgrade ------------------------------------------------------------------


def start_held_job(rig: Rig, controller: Controller) -> tuple[int, subprocess.Popen[bytes]]:
    """`srun` (in slurmctld's namespace) of one task on each Slurm node that lasts until
    released (`Controller.release`); its output in the rig's job.log. Returns the job's id
    and the srun process, once the step runs on every node."""
    names = [node.name for node in rig.slurm_nodes]
    srun = controller.srun_background("-N", str(len(names)), "-J", "held", "bash", "-c",
                                      held_job(CONTROLLER), log=rig.tmp / "job.log")  # fmt: skip
    steps = lambda: controller.squeue("-h", "-s", "-n", "held", "-o", "%i %N")  # noqa: E731
    wait_for(lambda: ".0 " in steps() or srun.poll() is not None, 60,
             f"the job's step running on {names}", controller.slurmctld_log, rig.tmp / "job.log",
             seen=steps)  # fmt: skip
    assert srun.poll() is None, f"srun ended: {tail(rig.tmp / 'job.log')}"
    job = int(steps().split(".")[0])
    assert controller.job(job).get("NodeList") == controller.client(
        "scontrol", "show", "hostlist", ",".join(names)).stdout.strip(), controller.job(job)  # fmt: skip
    return job, srun


def test_rolling_upgrade_keeps_every_job_container_and_address(rig: Rig, tmp_path: Path) -> None:
    """The job: a real Slurm job over the Slurm nodes (srun, a task on each), started
    before the first instance stops and released after the last is back; and every node's
    container (its main process: slurmd, or busybox's `sleep`). The new code: a copy of
    the `layerpy` package in another directory, run from there."""
    if rig.controller is None:
        pytest.skip(NO_SLURM)
    controller = rig.controller
    everyone = rig.nodes + rig.slurm_nodes
    names = [node.name for node in rig.slurm_nodes]
    code = tmp_path / "upgrade"
    shutil.copytree(Path(__import__("layerpy").__file__).parent, code / "layerpy")
    running = {node.name: node.container() for node in everyone}
    starts = {node.name: node.starts() for node in everyone}
    slurmd = controller.slurmd_started()
    job, srun = start_held_job(rig, controller)
    for node in rig.slurm_nodes:  # the prolog's mark: the agent reports the node busy
        wait_for(lambda n=node: rig.servers[0].node(n.name).get("busy") == "busy", 20,
                 f"{node.name} busy (the job's prolog)", node.agent_log)  # fmt: skip
    rolled = time.monotonic()
    for server in rig.servers:
        mine = server.owns()
        server.stop()
        stopped = time.monotonic()
        others = {other.name for other in rig.servers if other is not server}
        took = wait_for(lambda: all(rig.owners().get(n) in others for n in mine), 15,  # noqa: B023
                        f"{mine} (of {server.name}, stopped) owned by another")  # fmt: skip
        print(f"\nmeasured: {server.name} stopped, its nodes taken over in {took:.1f} s")
        server.start(code)
        assert f"{code}" in server.log_text().split("=== start")[-1]
        wait_for(lambda s=server: live(s), 20,
                 f"{server.name} (new code) live", server.log)  # fmt: skip
        print(f"measured: {server.name} replaced in {time.monotonic() - stopped:.1f} s")
        reports_advance(rig, f"{server.name} upgraded")
        assert controller.job(job).get("JobState") == "RUNNING", controller.job(job)
    print(f"measured: three instances rolled in {time.monotonic() - rolled:.1f} s, "
          f"job {job} running on {controller.job(job).get('NodeList')}")  # fmt: skip
    assert srun.poll() is None, f"srun ended: {tail(rig.tmp / 'job.log')}"
    release = controller.release(CONTROLLER)
    try:
        ended = wait_for(lambda: srun.poll() is not None, 60, f"job {job} ending once released",
                         controller.slurmctld_log, rig.tmp / "job.log",
                         *(node.agent_log for node in rig.slurm_nodes))  # fmt: skip
    finally:
        release.kill()
        release.wait()
    print(f"measured: job {job} ended {ended:.1f} s after its release")
    output = (rig.tmp / "job.log").read_text()
    assert srun.returncode == 0, f"srun exited {srun.returncode}: {output}"
    assert sorted(re.findall(r"job done on (\S+)", output)) == names, output
    wait_for(lambda: controller.job(job).get("JobState") == "COMPLETED", 30,
             f"job {job} COMPLETED", controller.slurmctld_log, seen=lambda: controller.job(job))  # fmt: skip
    assert controller.job(job).get("ExitCode") == "0:0", controller.job(job)
    log = controller.slurmctld_log.read_text(errors="replace")
    assert f"_job_complete: JobId={job} WEXITSTATUS 0" in log, tail(controller.slurmctld_log)
    states = controller.client("squeue", "-h", "-t", "all", "-o", "%i %T").stdout.split("\n")
    failed = [line for line in states if line.strip() and not line.endswith(" COMPLETED")]
    assert not failed, f"jobs not completed: {failed}"
    controller.wait_nodes(names, "idle", 30)
    assert controller.slurmd_started() == slurmd, "a slurmd started again during the upgrade"
    dhcp_renews(everyone, "after the upgrade")
    for node in everyone:
        assert node.container() == running[node.name], f"{node.name}'s container changed"
        pid = running[node.name]
        assert pid is not None and Path(f"/proc/{pid[0]}").exists(), f"{node.name}'s job died"
        assert node.starts() == starts[node.name], f"{node.name} restarted its container"


def summary(capture: Capture) -> str:
    """Each client's replies: type (2 OFFER, 5 ACK, 6 NAK), address and instance."""
    lines: dict[str, list[str]] = {}
    for reply in capture.replies():
        lines.setdefault(reply["mac"], []).append(
            f"{reply['type']}:{reply['yiaddr']} from {reply['server']}"
        )
    return "\n".join(f"  {mac}: {', '.join(seen)}" for mac, seen in sorted(lines.items()))


# --- 6. two instances, one segment, one address per client ------------------------------


def test_instances_on_one_segment_never_offer_one_client_two_addresses(rig: Rig) -> None:
    capture = Capture(rig)
    strangers = [Netns("lphx") for _ in range(4)]
    try:
        macs = [f"52:54:00:88:77:{10 + i:02x}" for i in range(len(strangers))]
        for ns, mac in zip(strangers, macs, strict=True):
            rig.plug(ns, mac)
        clients = dict(zip([*macs, *(node.mac for node in rig.nodes)],
                           [*strangers, *(node.ns for node in rig.nodes)], strict=True))  # fmt: skip
        for _ in range(2):  # each client twice: a lease it had is the one it gets again
            running = {mac: ns.popen(["busybox", "udhcpc", "-n", "-q", "-f", "-i", "eth0",
                                      "-t", "5", "-T", "2", "-s", "/bin/true"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for mac, ns in clients.items()}  # fmt: skip
            failed = [mac for mac, client in running.items() if client.wait(timeout=60)]
            assert not failed, f"no lease for {failed}; replies on the segment:\n{summary(capture)}"
    finally:
        capture.close()
        for ns in strangers:
            ns.close()
    replies = capture.replies()
    given: dict[str, set[str]] = {}
    for reply in replies:
        if reply["type"] in (2, 5):  # OFFER, ACK
            given.setdefault(reply["mac"], set()).add(reply["yiaddr"])
    servers = {reply["server"] for reply in replies}
    seen = summary(capture)
    assert len(servers) >= 2, f"replies from {servers} only: two instances must answer\n{seen}"
    assert all(len(addresses) == 1 for addresses in given.values()), (
        f"a client offered several addresses: {given}\n{seen}"
    )
    for node in rig.nodes:
        assert given.get(node.mac) == {node.ip}, f"{node.name} got {given.get(node.mac)}\n{seen}"
    pool = [next(iter(given[mac])) for mac in macs if mac in given]
    assert len(pool) == len(macs) and len(set(pool)) == len(pool), (
        f"pool addresses {dict(zip(macs, pool, strict=False))}: one each, none shared\n{seen}"
    )

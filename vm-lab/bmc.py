"""A virtual BMC for one lab VM: IPMI (RMCP+, pyghmi) and Redfish (HTTP) driving QEMU's QMP.

Power model: the VM's QEMU starts paused with ``-S`` (firmware has not run: "off"). The BMC
keeps its own power flag. On is ``system_reset`` + ``cont``; off is ``stop`` +
``system_reset`` (the next on boots afresh); cycle and reset are ``system_reset`` + ``cont``.
Status is the flag, so a VM frozen behind the BMC's back (QMP ``stop``) still reads "on"
and hangs, like a wedged machine. A boot override (IPMI ``chassis bootdev pxe``, Redfish
``BootSourceOverrideTarget``) is remembered until the next boot; lab VMs netboot anyway.

IPMI refuses cipher suite 17 with RMCP+ status 0x11 (no matching cipher suite): pyghmi's
server can only do suite 3 yet would accept a suite-17 proposal and answer in suite 3, which
pyghmi's client cannot follow; refused, the client retries with suite 3. Redfish is plain
HTTP with basic auth or session tokens: fine inside a lab namespace, not on a real network.

A slow or late BMC, as real ones are (they answer in seconds and take 90-200 s to reset):
``--delay S`` holds every IPMI reply and every Redfish answer back by S seconds (requests are
handled at once, in order, so the BMC's state moves as soon as a request arrives), and
``--start-after S`` keeps both ports closed for S seconds after the process starts.

Serial-over-LAN: one SOL payload (instance 1) bridged to the VM's serial line, QEMU's chardev
socket (``--console``). The BMC connects to it only while a payload is active: QEMU serves
one client at a time, and others use that socket too: the lab types into it (``Vm.type``),
and a layerpy may capture the console from it (so a lab captures through SOL or through the
socket, not both). A second activation is refused with 0x80 (payload already active on another
session), as real BMCs do, until the first session deactivates it, logs out or is silent
for ``SOL_IDLE`` seconds; any session may deactivate it (what ``ipmitool sol deactivate``
and pyghmi's ``force`` do). Get Payload Instance Info answers who holds it: pyghmi's
console asks it as its keepalive and ends when the answer is not its own session.

Runs inside the lab namespace, one process per VM (``start_bmc`` below). The password comes
from a file, never the command line.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import heapq
import itertools
import json
import queue
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pyghmi.ipmi import console as pyghmi_console
from pyghmi.ipmi.bmc import Bmc
from pyghmi.ipmi.private import serversession
from pyghmi.ipmi.private import session as pyghmi_session

from qmp_power import OFF_STATES, qmp

HERE = Path(__file__).resolve().parent
BMC_DEVICE = "bmc0"  # a port-less bridge in the lab namespace holding every BMC address
RESET_TYPES = ("On", "ForceOff", "ForceRestart", "PowerCycle")
NO_CIPHER_SUITE = 0x11  # RMCP+ status: no cipher suite match with proposed algorithms
SOL_PAYLOAD = 1  # IPMI payload type of Serial-over-LAN
SOL_CHUNK = 255  # characters per SOL packet, each way: acknowledgements count them in a byte
SOL_TICK = 0.02  # seconds between looks at the serial line while SOL is active
SOL_IDLE = 60.0  # seconds without a packet from the SOL session before its payload is freed
# (as a real BMC's session timeout: ipmitool sends a keepalive every 15 s, layerpy probes)
RECONNECT_EVERY = 0.5  # seconds between attempts to reach the VM's serial socket
PAYLOAD_ACTIVE, PAYLOAD_DISABLED, INVALID_DATA = 0x80, 0x81, 0xCC  # completion codes


class DelayedSender:
    """Every UDP packet this process sends (all are IPMI replies), sent `delay` seconds late
    by one thread in the order they were made: pyghmi sends through one module function."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.send = pyghmi_session._io_sendto
        self.queue: list[tuple[float, int, Any, bytes, Any]] = []
        self.order = itertools.count()
        self.ready = threading.Condition()
        threading.Thread(target=self.run, name="delayed-send", daemon=True).start()
        pyghmi_session._io_sendto = self.later

    def later(self, sock: Any, packet: bytes, sockaddr: Any) -> None:
        with self.ready:
            due = time.monotonic() + self.delay
            heapq.heappush(self.queue, (due, next(self.order), sock, bytes(packet), sockaddr))
            self.ready.notify()

    def run(self) -> None:
        while True:
            with self.ready:
                while not self.queue or self.queue[0][0] > time.monotonic():
                    self.ready.wait(self.queue[0][0] - time.monotonic() if self.queue else None)
                _, _, sock, packet, sockaddr = heapq.heappop(self.queue)
            self.send(sock, packet, sockaddr)


class Suite3Session(serversession.ServerSession):
    """pyghmi's server session, refusing every cipher suite but 3 (see the module doc)."""

    def create_open_session_response(self, request: bytearray) -> bytearray:
        algorithms = (request[12], request[20], request[28])  # auth, integrity, confidentiality
        if algorithms == (1, 1, 1):  # RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128
            return super().create_open_session_response(request)
        return bytearray([request[0], NO_CIPHER_SUITE, 0, 0]) + request[4:8]

    def __init__(self, *args: Any) -> None:
        self.heard = time.monotonic()  # the last packet from the client (SOL_IDLE)
        self._customkeepalives = None  # pyghmi's console looks for it when its client goes
        super().__init__(*args)

    def process_pktqueue(self) -> None:
        if self.pktqueue:
            self.heard = time.monotonic()
        super().process_pktqueue()

    def close_server_session(self) -> None:
        """pyghmi's hook for a client's logout: its SOL payload ends with it."""
        self.bmc.session_closed(self)

    def sessionless_data(self, data: bytes, sockaddr: Any) -> None:
        """Packets still queued here when pyghmi drops the session (a client logging in
        again from the same UDP port) go to the BMC: pyghmi calls this method, which its
        sessions lack, and the BMC's loop would end with an AttributeError."""
        self.bmc.sessionless_data(data, sockaddr)


class Suite3Bmc(Bmc):
    """pyghmi's BMC, opening RMCP+ sessions with Suite3Session (see the module doc)."""

    def sessionless_data(self, data: bytes, sockaddr: Any) -> None:
        if data[:4] != b"\x06\x00\xff\x07" or data[4:6] != b"\x06\x10":
            super().sessionless_data(data, sockaddr)
        elif len(data) >= 48:  # RMCP+ header, then a 32-byte open session request
            args = (self.authdata, self.kg, sockaddr, self.serversocket, data[16:], self.uuid)
            Suite3Session(*args, self)

    def session_closed(self, session: Suite3Session) -> None:
        """A client logged out (Suite3Session's hook): a BMC without SOL holds nothing of
        it. Without this method a logout ended the BMC's whole loop with an AttributeError
        (tests/proto/test_shutdown.py's stand-ins, whose clients log out when slow)."""


def peer(session: Suite3Session) -> str:
    """The client's address and port, which tell its sessions apart in the log."""
    return f"{session.sockaddr[0]}:{session.sockaddr[1]}"


class SerialBridge:
    """The VM's serial socket while an SOL payload is active, reconnected should QEMU restart.

    A thread of its own reads it into a queue that the BMC's loop empties: pyghmi's sessions
    are not thread-safe, so only that loop sends SOL packets.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.printed: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.lock = threading.Lock()  # the socket between this thread and the BMC's loop
        self.closed = threading.Event()
        # at once: what the client types right after activating would otherwise be lost
        self.sock: socket.socket | None = self.connect()
        threading.Thread(target=self.run, name="serial", daemon=True).start()

    def connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1)  # QEMU serves one client: a full backlog would block connect()
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            return None
        sock.settimeout(None)
        print(f"sol: serial line {self.path} connected", flush=True)
        return sock

    def run(self) -> None:
        sock = self.sock
        while not self.closed.is_set():
            if sock is None:  # the VM is not running (yet, or again)
                self.closed.wait(RECONNECT_EVERY)
                sock = self.connect()
                with self.lock:
                    if self.closed.is_set() and sock is not None:
                        sock.close()
                        return
                    self.sock = sock
                continue
            with contextlib.suppress(OSError):
                while data := sock.recv(4096):
                    self.printed.put(data)
            with self.lock:
                self.sock = None
                sock.close()
            sock = None

    def take(self) -> bytes:
        """All the VM printed since the last call."""
        chunks = []
        with contextlib.suppress(queue.Empty):
            while True:
                chunks.append(self.printed.get_nowait())
        return b"".join(chunks)

    def write(self, data: bytes) -> None:
        """Typed text to the VM; what a VM that does not read cannot take is dropped, as a
        UART's receive FIFO overruns, rather than holding up the BMC."""
        with self.lock:
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.send(data, socket.MSG_DONTWAIT)

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)  # ends the reader's recv()


class QemuBmc(Suite3Bmc):
    """One VM's BMC: power and boot override over IPMI, shared with the Redfish endpoint;
    Serial-over-LAN to the VM's serial socket `console_path` (refused without one)."""

    def __init__(
        self,
        qmp_path: Path,
        user: str,
        password: str,
        address: str,
        port: int,
        console_path: Path | None = None,
        sol_idle: float = SOL_IDLE,
    ) -> None:
        super().__init__({user: password}, port=port, address=address)
        # pyghmi ends a wait early (the loop's short ones while SOL is active) with a packet
        # to its socket at `myself`, the loopback, which a socket bound to the BMC's address
        # never receives: each wait lasted until the next packet from a client
        pyghmi_session.myself = address
        self.qmp_path = qmp_path
        self.lock = threading.Lock()  # IPMI runs in the main thread, Redfish in others
        (status,) = qmp(qmp_path, "query-status")
        self.powered = status["status"] not in OFF_STATES
        self.boot_target = "None"  # Redfish names: "None" or "Pxe"
        self.console_path, self.sol_idle = console_path, sol_idle
        self.sol: pyghmi_console.ServerConsole | None = None  # these three while SOL is active
        self.sol_session: Suite3Session | None = None
        self.bridge: SerialBridge | None = None

    # --- the power model, shared by both protocols ---------------------------------------

    def _boot(self) -> None:
        print("power: reset and boot", flush=True)  # tests read power commands here
        qmp(self.qmp_path, "system_reset", "cont")
        self.powered = True
        self.boot_target = "None"  # a boot override lasts one boot

    def power_on(self) -> None:
        with self.lock:
            if not self.powered:
                self._boot()

    def power_off(self) -> None:
        with self.lock:
            if self.powered:
                print("power: off", flush=True)
                qmp(self.qmp_path, "stop", "system_reset")
                self.powered = False

    def power_reset(self) -> None:
        """Reset and cycle both boot afresh, from off too, and thaw a frozen VM."""
        with self.lock:
            self._boot()

    power_cycle = power_reset

    def get_power_state(self) -> str:
        return "on" if self.powered else "off"

    def set_boot_device(self, bootdevice: str) -> None:
        with self.lock:
            self.boot_target = "Pxe" if bootdevice == "network" else "None"

    def get_boot_device(self) -> str:
        return "network" if self.boot_target == "Pxe" else "default"

    def get_system_guid(self) -> uuid.UUID:
        return self.uuid

    # --- Serial-over-LAN (see the module doc) --------------------------------------------

    def serve(self) -> None:
        """pyghmi's loop (``Bmc.listen``), also sending what the VM printed while SOL is
        active."""
        while True:
            pyghmi_session.Session.wait_for_rsp(SOL_TICK if self.sol else 30)
            if self.sol is not None:
                self.pump_sol()

    def pump_sol(self) -> None:
        assert self.sol is not None and self.sol_session is not None and self.bridge
        if time.monotonic() - self.sol_session.heard > self.sol_idle:
            return self.release_sol(f"the session was silent for {self.sol_idle:g} s")
        sol, printed = self.sol, self.bridge.take()
        for start in range(0, len(printed), SOL_CHUNK):
            if self.sol is not sol or sol.broken:  # released while it waited for an ack
                return
            sol.send_data(printed[start : start + SOL_CHUNK])  # returns once acknowledged

    def is_active(self) -> bool:
        return True  # SOL works whether the machine is on or off, as on real BMCs

    def activate_payload(self, request: dict[str, Any], session: Suite3Session) -> None:
        data = request["data"]
        if self.console_path is None:
            return session.send_ipmi_response(code=PAYLOAD_DISABLED)
        if len(data) < 2 or (data[0], data[1]) != (SOL_PAYLOAD, 1):
            return session.send_ipmi_response(code=INVALID_DATA)
        # pyghmi's answer gives the sizes as 1 and the port big-endian: ipmitool reads a
        # little-endian port, and pyghmi's client would send one character per packet
        size, port = list(struct.pack("<H", SOL_CHUNK)), list(struct.pack("<H", self.port))
        answer = [0, 0, 0, 0, *size, *size, *port, 0xFF, 0xFF]
        if self.sol is not None and session is self.sol_session:
            # a client that resent its activation (our answer was late: a busy machine) gets
            # the same answer again, not "active on another session", which ended it
            return session.send_ipmi_response(data=answer)
        if self.sol is not None:
            return session.send_ipmi_response(code=PAYLOAD_ACTIVE)
        session.send_ipmi_response(data=answer)
        self.sol_session, self.bridge = session, SerialBridge(self.console_path)
        self.sol = pyghmi_console.ServerConsole(session, lambda data: self.typed(session, data))
        self.sol.maxoutcount = SOL_CHUNK  # pyghmi's 256 overflows the client's ack count
        print(f"sol: activated by the session of {peer(session)}", flush=True)

    def deactivate_payload(self, request: dict[str, Any], session: Suite3Session) -> None:
        if self.sol is None:
            return session.send_ipmi_response(code=PAYLOAD_ACTIVE)  # "already deactivated"
        session.send_ipmi_response()
        self.release_sol(f"deactivated by the session of {peer(session)}")

    def handle_raw_request(self, request: dict[str, Any], session: Suite3Session) -> None:
        if (request["netfn"], request["command"]) == (6, 0x4B):  # get payload instance info
            owner = self.sol_session.managedsessionid if self.sol_session else bytes(4)
            return session.send_ipmi_response(data=[*owner, *bytes(8)])
        super().handle_raw_request(request, session)

    def typed(self, session: Suite3Session, data: bytes | dict[str, Any]) -> None:
        """What `session`'s SOL client typed, or (a dict) its console's failure: the client
        stopped acknowledging. A session whose payload was released may still send."""
        if session is not self.sol_session:
            return
        if isinstance(data, dict):
            self.release_sol(f"the client stopped answering ({data})")
        elif self.bridge is not None:
            self.bridge.write(data)

    def session_closed(self, session: Suite3Session) -> None:
        if session is self.sol_session:
            self.release_sol("its session logged out")

    def release_sol(self, why: str) -> None:
        if self.sol is None or self.bridge is None:
            return
        print(f"sol: released: {why}", flush=True)
        self.sol.close()  # its client's next packet is answered "deactivated"
        self.bridge.close()
        self.sol = self.sol_session = self.bridge = None


# --- Redfish -------------------------------------------------------------------------------

SYSTEM = "/redfish/v1/Systems/1"
SESSIONS = "/redfish/v1/SessionService/Sessions"


class RedfishHandler(BaseHTTPRequestHandler):
    """Just enough Redfish for a power driver: one system, its reset action and boot
    override, sessions and basic auth."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes
    server: RedfishServer

    def do_GET(self) -> None:
        self.route("GET")

    def do_POST(self) -> None:
        self.route("POST")

    def do_PATCH(self) -> None:
        self.route("PATCH")

    def do_DELETE(self) -> None:
        self.route("DELETE")

    def route(self, method: str) -> None:
        time.sleep(self.server.delay)  # a slow BMC (--delay): each request in its own thread
        path = self.path.split("?")[0].rstrip("/")
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            return self.error(400, "MalformedJSON", "the request body is not JSON")
        public = path == "/redfish/v1" or (method, path) == ("POST", SESSIONS)
        if not public and not self.authorized():
            return self.error(401, "NoValidSession", "basic auth or X-Auth-Token needed")
        try:
            self.dispatch(method, path, body)
        except (OSError, RuntimeError) as error:  # QMP: QEMU gone or refusing
            self.error(500, "InternalError", str(error))

    def dispatch(self, method: str, path: str, body: dict[str, Any]) -> None:
        bmc = self.server.bmc
        match method, path:
            case "GET", "/redfish/v1":
                self.reply(200, service_root(bmc))
            case "GET", "/redfish/v1/Systems":
                members = [{"@odata.id": SYSTEM}]
                self.reply(200, {"@odata.id": path, "Members": members, "Members@odata.count": 1})
            case "GET", "/redfish/v1/Systems/1":
                self.reply(200, system(bmc))
            case "PATCH", "/redfish/v1/Systems/1":
                self.patch_boot(body.get("Boot", {}))
            case "POST", "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset":
                self.reset(body.get("ResetType"))
            case "POST", "/redfish/v1/SessionService/Sessions":
                self.login(body)
            case "DELETE", _ if path.startswith(SESSIONS + "/"):
                if self.server.sessions.pop(path.rsplit("/", 1)[1], None):
                    self.reply(204)
                else:
                    self.error(404, "ResourceMissingAtURI", path)
            case "GET", _ if path in (SESSIONS, "/redfish/v1/SessionService"):
                self.reply(200, {"@odata.id": path, "Sessions": {"@odata.id": SESSIONS}})
            case _:
                self.error(404 if method == "GET" else 405, "ResourceMissingAtURI", path)

    def authorized(self) -> bool:
        token = self.headers.get("X-Auth-Token")
        if token:
            return token in self.server.sessions.values()
        scheme, _, credentials = (self.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        with contextlib.suppress(ValueError):
            user, _, password = base64.b64decode(credentials).decode().partition(":")
            return self.server.bmc.authdata.get(user) == password
        return False

    def login(self, body: dict[str, Any]) -> None:
        if self.server.bmc.authdata.get(body.get("UserName")) != body.get("Password"):
            return self.error(401, "NoValidSession", "wrong user name or password")
        session_id, token = secrets.token_hex(4), secrets.token_urlsafe(24)
        self.server.sessions[session_id] = token
        location = f"{SESSIONS}/{session_id}"
        headers = {"X-Auth-Token": token, "Location": location}
        self.reply(201, {"@odata.id": location, "Id": session_id}, headers)

    def reset(self, reset_type: Any) -> None:
        bmc = self.server.bmc
        actions = {
            "On": bmc.power_on,
            "ForceOff": bmc.power_off,
            "ForceRestart": bmc.power_reset,
            "PowerCycle": bmc.power_cycle,
        }
        if reset_type not in actions:
            allowed = ", ".join(RESET_TYPES)
            return self.error(400, "ActionParameterValueNotInList", f"ResetType: one of {allowed}")
        actions[reset_type]()
        self.reply(204)

    def patch_boot(self, boot: dict[str, Any]) -> None:
        bmc = self.server.bmc
        target = boot.get("BootSourceOverrideTarget", bmc.boot_target)
        enabled = boot.get("BootSourceOverrideEnabled", "Once")
        if target not in ("Pxe", "None") or enabled not in ("Once", "Disabled"):
            message = "Boot: BootSourceOverrideTarget Pxe|None, BootSourceOverrideEnabled Once"
            return self.error(400, "PropertyValueNotInList", message)
        pxe_once = (target, enabled) == ("Pxe", "Once")
        bmc.set_boot_device("network" if pxe_once else "default")
        self.reply(204)

    def reply(self, code: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if code == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="lab-bmc"')
        if data:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, code: int, key: str, message: str) -> None:
        info = [{"MessageId": f"Base.1.8.{key}", "Message": message}]
        body = {"code": f"Base.1.8.{key}", "message": message, "@Message.ExtendedInfo": info}
        self.reply(code, {"error": body})


def service_root(bmc: QemuBmc) -> dict[str, Any]:
    return {
        "@odata.id": "/redfish/v1",
        "Id": "RootService",
        "Name": "Lab BMC",
        "RedfishVersion": "1.6.0",
        "UUID": str(bmc.uuid),
        "Systems": {"@odata.id": "/redfish/v1/Systems"},
        "SessionService": {"@odata.id": "/redfish/v1/SessionService"},
        "Links": {"Sessions": {"@odata.id": SESSIONS}},
    }


def system(bmc: QemuBmc) -> dict[str, Any]:
    target = bmc.boot_target
    return {
        "@odata.id": SYSTEM,
        "Id": "1",
        "Name": bmc.qmp_path.stem,
        "UUID": str(bmc.uuid),
        "PowerState": "On" if bmc.powered else "Off",
        "Boot": {
            "BootSourceOverrideTarget": target,
            "BootSourceOverrideEnabled": "Once" if target == "Pxe" else "Disabled",
            "BootSourceOverrideTarget@Redfish.AllowableValues": ["None", "Pxe"],
        },
        "Actions": {
            "#ComputerSystem.Reset": {
                "target": f"{SYSTEM}/Actions/ComputerSystem.Reset",
                "ResetType@Redfish.AllowableValues": list(RESET_TYPES),
            }
        },
    }


class RedfishServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], bmc: QemuBmc, delay: float = 0.0) -> None:
        super().__init__(address, RedfishHandler)
        self.bmc = bmc
        self.delay = delay
        self.sessions: dict[str, str] = {}  # session id -> token


# --- running it ----------------------------------------------------------------------------


def oob_bridge(lab: Any) -> str:
    """The lab's out-of-band bridge (``bmc0``), made on first use: its name."""
    if lab.run(["ip", "link", "show", BMC_DEVICE], check=False).returncode:
        lab.run(["ip", "link", "add", BMC_DEVICE, "type", "bridge"])
        lab.run(["ip", "link", "set", BMC_DEVICE, "up"])
    return BMC_DEVICE


def start_bmc(
    lab: Any,
    vm_name: str,
    address: str,
    password_file: Path,
    *,
    user: str = "admin",
    ipmi_port: int = 623,
    redfish_port: int = 8000,
    prefix: int = 24,
    timeout: float = 15,
    delay: float = 0.0,
    start_after: float = 0.0,
    sol_idle: float = SOL_IDLE,
) -> subprocess.Popen:
    """Start the BMC of lab VM `vm_name` at `address` inside the lab's namespace.

    The address goes on ``bmc0``, a bridge without ports created on first use (this kernel
    has no dummy interfaces): an out-of-band network reachable only from inside the
    namespace. Returns once the BMC listens on both ports; its log is
    ``<run_dir>/<vm_name>.bmc.log``. The interpreter is this one: it needs pyghmi. SOL goes
    to the VM's serial socket, ``<run_dir>/<vm_name>.console`` as ``lab.qemu_command``
    names it.

    `delay` makes every answer that many seconds late. With `start_after`, the BMC opens
    its ports only that many seconds from now (a BMC still resetting): this returns once
    the process runs, with the address already up and nothing listening behind it.
    `sol_idle` is how long a silent SOL session keeps the payload.
    """
    oob_bridge(lab)
    shown = lab.run(["ip", "-o", "-4", "addr", "show", "dev", BMC_DEVICE]).stdout
    if f" {address}/" not in shown:
        lab.run(["ip", "addr", "add", f"{address}/{prefix}", "dev", BMC_DEVICE])
    log = lab.run_dir / f"{vm_name}.bmc.log"
    start = log.stat().st_size if log.exists() else 0
    cmd = [sys.executable, str(HERE / "bmc.py"), "--qmp", str(lab.run_dir / f"{vm_name}.qmp")]
    cmd += ["--console", str(lab.run_dir / f"{vm_name}.console")]  # as qemu_command makes it
    cmd += ["--address", address, "--ipmi-port", str(ipmi_port)]
    cmd += ["--redfish-port", str(redfish_port), "--user", user]
    cmd += ["--delay", str(delay), "--start-after", str(start_after)]
    cmd += ["--sol-idle", str(sol_idle)]
    proc = lab.popen([*cmd, "--password-file", str(password_file)], log=log)
    deadline = time.monotonic() + timeout
    awaited = b"bmc starting" if start_after else b"bmc ready"
    while awaited not in log.read_bytes()[start:]:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{vm_name}: BMC did not come up:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qmp", type=Path, required=True, help="the VM's QMP unix socket")
    parser.add_argument("--console", type=Path, help="the VM's serial socket, for SOL")
    parser.add_argument("--address", required=True, help="IP address to serve on")
    parser.add_argument("--ipmi-port", type=int, default=623)
    parser.add_argument("--redfish-port", type=int, default=8000)
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password-file", type=Path, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to hold each answer")
    parser.add_argument("--start-after", type=float, default=0.0, help="seconds before listening")
    parser.add_argument("--sol-idle", type=float, default=SOL_IDLE, help="SOL session timeout")
    args = parser.parse_args(argv)
    password = args.password_file.read_text().strip()
    print(f"bmc starting: listening in {args.start_after:g} s, delay {args.delay:g} s", flush=True)
    time.sleep(args.start_after)
    if args.delay > 0:
        DelayedSender(args.delay)
    bmc = QemuBmc(
        args.qmp, args.user, password, args.address, args.ipmi_port, args.console, args.sol_idle
    )
    redfish = RedfishServer((args.address, args.redfish_port), bmc, args.delay)
    threading.Thread(target=redfish.serve_forever, daemon=True).start()
    state = bmc.get_power_state()
    print(
        f"bmc ready: {args.address} ipmi {args.ipmi_port} redfish {args.redfish_port} "
        f"power {state}",
        flush=True,
    )
    bmc.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())

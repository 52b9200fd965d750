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
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from pyghmi.ipmi.bmc import Bmc
from pyghmi.ipmi.private import serversession
from pyghmi.ipmi.private import session as pyghmi_session

HERE = Path(__file__).resolve().parent
BMC_DEVICE = "bmc0"  # a port-less bridge in the lab namespace holding every BMC address
OFF_STATES = {"prelaunch", "shutdown"}  # QEMU run states of a machine that is not powered
RESET_TYPES = ("On", "ForceOff", "ForceRestart", "PowerCycle")
NO_CIPHER_SUITE = 0x11  # RMCP+ status: no cipher suite match with proposed algorithms


def qmp(path: Path, *commands: str) -> list[Any]:
    """Run QMP commands on one fresh connection: QEMU's QMP socket serves one client at a
    time, so holding it would lock out the lab and layerpy's qemu driver."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        stream = sock.makefile("rwb")
        json.loads(stream.readline())  # greeting
        results = []
        for name in ("qmp_capabilities", *commands):
            stream.write(json.dumps({"execute": name}).encode() + b"\n")
            stream.flush()
            while True:  # skip asynchronous events
                reply = json.loads(stream.readline() or b'{"error": {"desc": "EOF"}}')
                if "return" in reply or "error" in reply:
                    break
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error']['desc']}")
            results.append(reply["return"])
    return results[1:]


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


class QemuBmc(Suite3Bmc):
    """One VM's BMC: power and boot override over IPMI, shared with the Redfish endpoint."""

    def __init__(self, qmp_path: Path, user: str, password: str, address: str, port: int) -> None:
        super().__init__({user: password}, port=port, address=address)
        self.qmp_path = qmp_path
        self.lock = threading.Lock()  # IPMI runs in the main thread, Redfish in others
        (status,) = qmp(qmp_path, "query-status")
        self.powered = status["status"] not in OFF_STATES
        self.boot_target = "None"  # Redfish names: "None" or "Pxe"

    # --- the power model, shared by both protocols ---------------------------------------

    def _boot(self) -> None:
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
) -> subprocess.Popen:
    """Start the BMC of lab VM `vm_name` at `address` inside the lab's namespace.

    The address goes on ``bmc0``, a bridge without ports created on first use (this kernel
    has no dummy interfaces): an out-of-band network reachable only from inside the
    namespace. Returns once the BMC listens on both ports; its log is
    ``<run_dir>/<vm_name>.bmc.log``. The interpreter is this one: it needs pyghmi.

    `delay` makes every answer that many seconds late. With `start_after`, the BMC opens
    its ports only that many seconds from now (a BMC still resetting): this returns once
    the process runs, with the address already up and nothing listening behind it.
    """
    if lab.run(["ip", "link", "show", BMC_DEVICE], check=False).returncode:
        lab.run(["ip", "link", "add", BMC_DEVICE, "type", "bridge"])
        lab.run(["ip", "link", "set", BMC_DEVICE, "up"])
    shown = lab.run(["ip", "-o", "-4", "addr", "show", "dev", BMC_DEVICE]).stdout
    if f" {address}/" not in shown:
        lab.run(["ip", "addr", "add", f"{address}/{prefix}", "dev", BMC_DEVICE])
    log = lab.run_dir / f"{vm_name}.bmc.log"
    start = log.stat().st_size if log.exists() else 0
    cmd = [sys.executable, str(HERE / "bmc.py"), "--qmp", str(lab.run_dir / f"{vm_name}.qmp")]
    cmd += ["--address", address, "--ipmi-port", str(ipmi_port)]
    cmd += ["--redfish-port", str(redfish_port), "--user", user]
    cmd += ["--delay", str(delay), "--start-after", str(start_after)]
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
    parser.add_argument("--address", required=True, help="IP address to serve on")
    parser.add_argument("--ipmi-port", type=int, default=623)
    parser.add_argument("--redfish-port", type=int, default=8000)
    parser.add_argument("--user", default="admin")
    parser.add_argument("--password-file", type=Path, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to hold each answer")
    parser.add_argument("--start-after", type=float, default=0.0, help="seconds before listening")
    args = parser.parse_args(argv)
    password = args.password_file.read_text().strip()
    print(f"bmc starting: listening in {args.start_after:g} s, delay {args.delay:g} s", flush=True)
    time.sleep(args.start_after)
    if args.delay > 0:
        DelayedSender(args.delay)
    bmc = QemuBmc(args.qmp, args.user, password, args.address, args.ipmi_port)
    redfish = RedfishServer((args.address, args.redfish_port), bmc, args.delay)
    threading.Thread(target=redfish.serve_forever, daemon=True).start()
    state = bmc.get_power_state()
    print(
        f"bmc ready: {args.address} ipmi {args.ipmi_port} redfish {args.redfish_port} "
        f"power {state}",
        flush=True,
    )
    bmc.listen()
    return 0


if __name__ == "__main__":
    sys.exit(main())

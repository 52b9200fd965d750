"""What the benchmarks share: the reference nginx's configuration, a process's CPU.

nginx runs as one process (no master): its CPU is then that process's, where a worker's
would reach its master's figures only once reaped.
"""

import os
import subprocess
import sys
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) and of its reaped children."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """cpu_seconds, as user and system time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system, children_user, children_system = (int(tick) for tick in fields[11:15])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + children_user) / tick, (system + children_system) / tick


def nginx_config(directory: Path, server: str, connections: int) -> Path:
    """nginx.conf in `directory` (its pid, error log and temp files there too): sendfile,
    no access log, one process in the foreground, serving the `server { }` block given."""
    path = directory / "nginx.conf"
    path.write_text(f"""\
master_process off;
daemon off;
user root;
pid {directory}/nginx.pid;
error_log {directory}/nginx.err;
events {{ worker_connections {connections}; }}
http {{
  access_log off;
  sendfile on;
  keepalive_requests 1000;
  client_body_temp_path {directory}/nginx-tmp;
  server {{ {server} }}
}}
""")
    return path


def start_pinned(link, directory: Path, name: str, command: list[str], url: str,
                 cpu: str) -> subprocess.Popen:  # fmt: skip
    """`command` in the link's server namespace, pinned to `cpu`, once `url` answers from
    the client's side (its output in DIRECTORY/NAME.log)."""
    log = (directory / f"{name}.log").open("wb")
    process = link.server.popen(["taskset", "-c", cpu, *command], stdout=log, stderr=log)
    deadline = time.monotonic() + 30
    while link.client.run("curl", "-sfo", "/dev/null", url, check=False).returncode:
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{name} did not start: {(directory / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return process


def one_node_file(directory: Path, interface: str, server: str, node: str, port: int,
                  boot_sections: str, mac: str) -> Path:  # fmt: skip
    """The node file of the HTTP benches: bn001 alone, at the client's address `node`,
    served from `server` on `port` of its /24; `boot_sections` say its minOS and iPXE."""
    path = directory / "nodes.toml"
    path.write_text(f"""\
[server]
interface = "{interface}"
address = "{server}"
state_dir = "state"
dhcp_probe = 0
http_port = {port}

[network]
subnet = "{node.rsplit(".", 1)[0]}.0/24"

{boot_sections}
[groups.bench]
nodes = "bn001"
ip = "{node}"
mac = ["{mac}"]
""")
    return path

"""What the benchmarks share: the reference nginx's configuration, a process's CPU.

nginx runs as one process (no master): its CPU is then that process's, where a worker's
would reach its master's figures only once reaped.
"""

import os
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

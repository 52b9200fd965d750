"""The [cluster] table: this instance's place among instances that share their state
through etcd (docs/ha.md). Without it the server is one instance on its own, as ever.

    [cluster]
    etcd = ["https://10.0.0.5:2379", "https://10.0.0.6:2379", "https://10.0.0.7:2379"]
    name = "head1"               # this instance's; the rest of the file is the cluster's
    ca = "etcd/ca.pem"           # needed for https members
    cert = "etcd/head1.pem"      # a client certificate, if the members ask for one
    key = "etcd/head1-key.pem"
    user = "layerpy"             # etcd's own authentication, if enabled
    password_file = "etcd/password"
"""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from layerpy.config import values
from layerpy.config.reading import Reader, missing, open_to_all
from layerpy.config.records import ClusterConfig, NetworkConfig

KEYS = {
    "etcd", "name", "segment", "prefix", "lease_ttl", "ca", "cert", "key", "user", "password_file",
}  # fmt: skip


def read(r: Reader, data: dict[str, Any], network: NetworkConfig | None) -> ClusterConfig | None:
    """The table checked whole: members' URLs, TLS files that exist (the key and the
    password private), no password in clear off loopback."""
    if "cluster" not in data:
        return None
    table = r.table(data, "cluster", KEYS)
    get = r.getter(table, "cluster")
    etcd = get("etcd", list, values.etcd_urls, required=True)
    name = get("name", str, values.label, required=True)
    segment = get("segment", str, values.subnet)
    if segment is not None and network is not None and not segment.subnet_of(network.subnet):
        r.problem(
            "cluster.segment",
            f"{segment} is not inside network.subnet {network.subnet}: this instance would "
            "serve none of the nodes",
        )
    prefix = get("prefix", str, values.key_prefix, default=ClusterConfig.prefix)
    lease_ttl = get("lease_ttl", int, values.lease_ttl, default=ClusterConfig.lease_ttl)
    tls = {key: get(key, str, r.path) for key in ("ca", "cert", "key")}
    user = get("user", str)
    password = r.password(get, "cluster", private=True)
    _check_tls(r, etcd or (), tls)
    if (user is None) != ("password_file" not in table):
        r.problem("cluster", "give both user and password_file (etcd's authentication), or neither")
    clear = [url for url in etcd or () if url.startswith("http:") and not _loopback(url)]
    if password is not None and clear:
        r.problem(
            "cluster.password_file",
            f"the password would cross the network in clear to {', '.join(clear)}: "
            "use https:// members (and ca)",
        )
    if etcd is None or name is None or network is None:
        return None
    return ClusterConfig(etcd, name, str(segment or network.subnet), prefix, lease_ttl,
                         tls["ca"], tls["cert"], tls["key"], user, password)  # fmt: skip


def _check_tls(r: Reader, etcd: tuple[str, ...], tls: dict[str, Any]) -> None:
    for key, path in tls.items():
        if path is None:
            continue
        if why := missing(path):
            r.problem(f"cluster.{key}", f"{path} {why}")
        elif key == "key" and (why := open_to_all(path, path.stat().st_mode)):
            r.problem("cluster.key", why)
    secure = [url for url in etcd if url.startswith("https:")]
    if secure and tls["ca"] is None:
        r.problem(
            "cluster.ca",
            f"is required for https:// members ({secure[0]}): the CA certificate that signed "
            "their certificates",
        )
    if (tls["cert"] is None) != (tls["key"] is None):
        r.problem("cluster", "give both cert and key (a client certificate for etcd), or neither")
    elif tls["cert"] is not None and not secure:
        r.problem("cluster.cert", "a client certificate is for https:// members only")


def _loopback(url: str) -> bool:
    host = url.split("://", 1)[1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False

"""Trim Python's standard library to what the layerpy agent uses, for the minOS.

Run with the interpreter that will ship (Debian's python3.11 from the staged debs), so the
byte code matches it exactly:

  trim.py trace                 exercise the agent, print the stdlib files it imported
  trim.py install LIST SRC DST  byte-compile LIST (from SRC) as sourceless .pyc into DST
  trim.py verify                exercise again inside the finished tree (chroot); fail loudly

Tracing what the agent really imports (plus the lazy imports exercise() provokes) keeps
~80 modules instead of the ~140 modulefinder reports, because modulefinder follows every
``import`` in every ``try`` block (ssl, lzma, bz2, ftplib, importlib.metadata, ...).
"""

from __future__ import annotations

import os
import sys

# Never shipped: need libraries the minOS does not carry, or Debian's host hooks.
EXCLUDE = {"sitecustomize", "usercustomize", "ssl", "_ssl", "_hashlib", "bz2", "_bz2", "lzma",
           "_lzma", "readline", "_sqlite3"}  # fmt: skip


def exercise() -> None:
    """Walk every code path of the agent that imports something, without any network.

    Touches loopback only (a connect to 127.0.0.1:1 that is refused); a canned HTTP
    response is parsed from memory instead of a server.
    """
    import codecs
    import io
    import json
    import runpy
    import shutil
    import socket
    import subprocess
    import tempfile
    import traceback
    import urllib.error
    import urllib.request

    from layerpy.agent import core, net
    from layerpy.proto import agent as contract
    from layerpy.proto import lldp as codec

    runpy._get_module_details("layerpy.agent")  # what `python -m layerpy.agent` resolves
    for name in ("utf-8", "ascii", "latin-1", "idna"):
        codecs.lookup(name)
    "n\u00f6de.example".encode("idna")  # what getaddrinfo does with a str host name
    cfg = contract.Cmdline.parse(
        "layerpy.server=http://localhost:1 layerpy.node=n1 layerpy.token=t0"
        ' BOOTIF=01-52-54-00-12-34-56 x="a b"'
    )
    assert cfg.ok and cfg.bootif == "52:54:00:12:34:56", cfg
    out = core.post_json("http://localhost:1/api/v1/agent/report", {"a": 1}, 0.5)
    assert out.kind == "unreachable", out.kind
    out = core.post_json("http://127.0.0.1:1/api/v1/agent/report", {"a": 1}, 0.5)
    assert out.kind == "unreachable", out.kind
    with urllib.request.urlopen("data:application/json,%7B%22heartbeat%22%3A%205%7D") as r:
        assert json.loads(r.read()) == {"heartbeat": 5}

    class FakeSock:
        def __init__(self, data: bytes) -> None:
            self.data = data

        def makefile(self, *args: object, **kw: object) -> io.BytesIO:
            return io.BytesIO(self.data)

    import http.client

    body = b'{"heartbeat": 5}'
    resp = http.client.HTTPResponse(
        FakeSock(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    )
    resp.begin()
    err = urllib.error.HTTPError("http://x/", resp.status, resp.reason, resp.headers, resp)
    assert err.code == 403 and json.loads(err.read()) == {"heartbeat": 5}
    err.close()
    try:
        raise RuntimeError("traceback path")
    except RuntimeError:
        assert "traceback path" in traceback.format_exc()
    subprocess.run(["/bin/true"], check=False, timeout=10)
    neighbor = codec.Neighbor("02:00:00:00:0a:01", 4, "swp1", 5, 120)
    assert codec.parse_frame(codec.build_frame(bytes(6), neighbor)).port_id == "swp1"
    net.interfaces("/nonexistent")
    net.ipv4_address("lo")
    net.source_address("127.0.0.1", 1)
    socket.gethostname()
    tmp = tempfile.mkdtemp()
    try:
        log = core.Log("n1", io.StringIO())
        agent = core.Agent(cfg, log, no_net=True, state_dir=tmp)
        agent._heard(neighbor, "lo")
        body_ = contract.encode(agent.body(agent.observe(), contract.Event.HELLO))
        agent._save_state()
        assert contract.Report.from_json(json.loads(json.dumps(body_))).node == "n1"
        answer = contract.Answer(node="n1", identity=contract.Identity("n2", "t"))
        agent._read_answer(contract.encode(answer))
        agent._read_answer({"protocol": "9.0"})
        offer = contract.BeatOffer(1, "00" * 16)  # a datagram beat to 127.0.0.1:1: no reply
        agent._read_answer(contract.encode(contract.Answer(node="n1", beat=offer)))
        agent._answered_by = agent.servers.current
        assert not agent._beat()
        exercise_runner(tmp)
    finally:
        shutil.rmtree(tmp)


def exercise_runner(tmp: str) -> None:
    """The image runner without mounts or containers: a data: URL download with its hash
    check, a tar unpacked, the runner's bookkeeping."""
    import base64
    import hashlib
    import io
    import json
    import tarfile

    from layerpy.agent import cgroupns, container, image  # noqa: F401 (cgroupns: ctypes)
    from layerpy.proto import agent as contract

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("etc/marker")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"ok\n"))
    data = buf.getvalue()
    url = "data:application/x-tar;base64," + base64.b64encode(data).decode()
    path, root = os.path.join(tmp, "rootfs.tar"), os.path.join(tmp, "root")
    image.download(url, path, hashlib.sha256(data).hexdigest(), len(data), "sha256:x")
    os.mkdir(root)
    image.extract_tar(path, root)
    with open(os.path.join(root, "etc", "marker"), "rb") as f:
        assert f.read() == b"ok\n"
    runner = container.Runner(os.path.join(tmp, "run"), lambda msg: None, "n1", console=os.devnull)
    runner.want(None)
    runner.tick()
    json.dumps(contract.encode(runner.report()))


def trace() -> None:
    """Print stdlib files (.py and extension .so) imported by exercise(), one per line."""
    exercise()
    stdlib = os.path.realpath(sys._stdlib_dir)
    files = set()
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in EXCLUDE:
            continue
        spec = getattr(mod, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if not origin or origin in ("frozen", "built-in"):
            continue  # frozen and built-in modules live in the interpreter binary
        path = os.path.realpath(origin)
        if os.path.commonpath([path, stdlib]) == stdlib:
            files.add(os.path.relpath(path, stdlib))
    for f in sorted(files):
        print(f)


def install(listfile: str, src: str, dst: str, dprefix: str, optimize: int) -> None:
    """Byte-compile each listed .py to DST/<same path>c; copy .so files as they are.

    Unchecked-hash pycs carry no source mtime, so the output depends only on the source.
    """
    import py_compile
    import shutil

    with open(listfile, encoding="utf-8") as f:
        rels = sorted(line.strip() for line in f if line.strip())
    for rel in rels:
        s = os.path.join(src, rel)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        if rel.endswith(".py"):
            py_compile.compile(
                s,
                cfile=os.path.join(dst, rel + "c"),
                dfile=os.path.join(dprefix, rel),
                doraise=True,
                optimize=optimize,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        else:
            shutil.copy2(s, os.path.join(dst, rel))


def verify() -> None:
    """Run exercise() in the trimmed tree and check that nothing came from elsewhere."""
    exercise()
    bad = []
    for name, mod in sorted(sys.modules.items()):
        origin = getattr(getattr(mod, "__spec__", None), "origin", None) or ""
        if origin.startswith("/") and not origin.startswith("/usr/lib/"):
            bad.append(f"{name} from {origin}")
    if bad:
        raise SystemExit("modules from outside the image: " + ", ".join(bad))
    n = sum(1 for m in sys.modules.values() if getattr(m, "__file__", None))
    print(f"verify: agent code paths import fine ({n} modules from files)")


def main(argv: list[str]) -> None:
    cmd = argv[0] if argv else ""
    if cmd == "trace":
        trace()
    elif cmd == "install" and len(argv) == 6:
        install(argv[1], argv[2], argv[3], argv[4], int(argv[5]))
    elif cmd == "verify":
        verify()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

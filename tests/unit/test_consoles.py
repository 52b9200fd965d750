"""Console capture: what is kept, what is hidden, what counts as a dying kernel, and that a
broken or slow party never stops it (links played by the test; the real QEMU socket and
SOL are in tests/proto and tests/e2e)."""

from __future__ import annotations

import asyncio
import functools

import pytest

import layerpy.consoles.capture as capture
from layerpy.consoles import Consoles, Notice
from layerpy.consoles.link import ConsoleError
from layerpy.power.base import PowerSpec

SPEC = PowerSpec("none", console="/run/test/{node}.console")


class Link:
    """A console link whose bytes the test sends; it records what was typed."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[bytes] = asyncio.Queue()
        self.typed = b""

    async def read(self) -> bytes:
        return await self.incoming.get()

    async def write(self, data: bytes) -> None:
        self.typed += data

    async def close(self) -> None:
        pass


def scenario(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def settled() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def started(tmp_path, opener=None) -> tuple[Consoles, list[tuple[str, str, str]], Link]:
    link = Link()
    problems: list[tuple[str, str, str]] = []

    async def one_link(node: str, spec: PowerSpec) -> Link:
        return link

    consoles = Consoles(tmp_path / "consoles", lambda *p: problems.append(p), opener or one_link)
    consoles.sync({"cn001": SPEC})
    await settled()
    return consoles, problems, link


@scenario
async def test_boot_tokens_never_reach_the_log_or_a_viewer(tmp_path) -> None:
    consoles, _, link = await started(tmp_path)
    viewer = consoles.attach("cn001")
    for chunk in (b"Kernel command line: console=ttyS0 layerpy.to", b"ken=lpy_s3cr",
                  b"et quiet\r\n", b"login: "):  # fmt: skip
        link.incoming.put_nowait(chunk)
        await settled()
    seen = b"".join(viewer.get_nowait() for _ in range(viewer.qsize()))
    kept = consoles.tail("cn001", 4096)
    for shown in (seen, kept):
        assert shown == b"Kernel command line: console=ttyS0 layerpy.token=*** quiet\r\nlogin: "
    consoles._flush(consoles._consoles["cn001"])
    assert b"s3cr" not in (tmp_path / "consoles" / "cn001.log").read_bytes()
    await consoles.close()


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (b"[   12.345678] Kernel panic - not syncing: VFS: Unable to mount root fs", "panic"),
        (b"Kernel panic - not syncing: Attempted to kill init!", "panic"),
        (b"<0>[ 1.5] Kernel panic - not syncing: sysrq triggered crash", "panic"),
        (b"[  99.1] Oops: 0002 [#1] PREEMPT SMP NOPTI", "oops"),
        (b"[ 5.0] BUG: unable to handle page fault for address: 0000000000001234", "oops"),
        (b"[ 242.1] INFO: task kworker/0:1:12 blocked for more than 120 seconds.", "hung_task"),
        (b"[ 60.2] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [a.out:77]", "lockup"),
        (b"root@cn001:~# grep 'Kernel panic - not syncing' /var/log/kern.log", None),
        (b"Nov 25 10:00:00 cn001 kernel: [ 12.3] Kernel panic - not syncing: x", None),
        (b"echo Oops", None),
    ],
)
@scenario
async def test_a_dying_kernel_is_told_from_text_about_one(tmp_path, line, kind) -> None:
    consoles, problems, link = await started(tmp_path)
    link.incoming.put_nowait(b"\r\n" + line[:20])
    link.incoming.put_nowait(line[20:] + b"\r\n")
    await settled()
    assert [p[1] for p in problems] == ([kind] if kind else [])
    if kind:
        assert problems[0][2] == line.decode().strip()
    await consoles.close()


@scenario
async def test_the_log_is_rotated_and_the_tail_spans_both_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capture, "FILE_LIMIT", 1000)
    consoles, _, link = await started(tmp_path)
    console = consoles._consoles["cn001"]
    for number in range(30):
        link.incoming.put_nowait(f"line {number:04d} {'x' * 90}\n".encode())
        await settled()
        consoles._flush(console)
    files = sorted(p.name for p in (tmp_path / "consoles").iterdir())
    assert files == ["cn001.log", "cn001.log.1"]
    assert all(p.stat().st_size <= 1000 for p in (tmp_path / "consoles").iterdir())
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "consoles").iterdir())
    older, newer = ((tmp_path / "consoles" / name).read_bytes() for name in files[::-1])
    tail = consoles.tail("cn001", 1500)
    assert tail == older + newer and tail.endswith(f"line 0029 {'x' * 90}\n".encode())
    assert older.startswith(b"line 0018")  # the oldest kept: the rest went with the rotation
    await consoles.close()


@scenario
async def test_a_slow_viewer_is_told_and_let_go(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capture, "VIEWER_QUEUE", 4)
    consoles, _, link = await started(tmp_path)
    slow, keen = consoles.attach("cn001"), consoles.attach("cn001")
    for number in range(6):
        link.incoming.put_nowait(f"{number}\n".encode())
        await settled()
        while not keen.empty():
            keen.get_nowait()
    left = [slow.get_nowait() for _ in range(slow.qsize())]
    assert isinstance(left[-2], Notice) and left[-1] is None
    link.incoming.put_nowait(b"still there\n")
    await settled()
    assert keen.get_nowait() == b"still there\n" and slow.empty()
    assert await consoles.type("cn001", b"ls\r") and link.typed == b"ls\r"
    await consoles.close()


@scenario
async def test_a_link_that_breaks_in_any_way_is_tried_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capture, "BACKOFF", (0.01, 0.02))
    attempts = []
    good = Link()

    async def flaky(node: str, spec: PowerSpec) -> Link:
        attempts.append(node)
        if len(attempts) == 1:
            raise ConsoleError(f"{node}: console socket: Connection refused")
        if len(attempts) == 2:
            raise RuntimeError("a driver's bug")
        return good

    consoles, _, _ = await started(tmp_path, flaky)
    for _ in range(100):
        if consoles.state("cn001") == "connected":
            break
        await asyncio.sleep(0.01)
    assert len(attempts) == 3 and consoles.state("cn001") == "connected"
    good.incoming.put_nowait(b"")  # the far end hangs up: connecting again
    for _ in range(100):
        if len(attempts) == 4:
            break
        await asyncio.sleep(0.01)
    assert len(attempts) == 4
    await consoles.close()  # never raises, whatever the links did


@scenario
async def test_consoles_beyond_the_plans_share_are_not_captured(tmp_path, caplog) -> None:
    """The descriptor plan's share: the first in name order are captured, the rest said."""

    async def never(node: str, spec: PowerSpec) -> Link:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    consoles = Consoles(tmp_path / "consoles", lambda *p: None, never, most=2)
    consoles.sync({name: SPEC for name in ("cn003", "cn001", "cn002")})
    try:
        assert [consoles.has(name) for name in ("cn001", "cn002", "cn003")] == [True, True, False]
        said = "3 consoles in the node file, room for 2 in the descriptor plan: not capturing "
        assert said + "cn003; raise LimitNOFILE" in caplog.text
    finally:
        await consoles.close()

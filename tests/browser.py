"""Debian's Chromium, headless, driven over the DevTools protocol for the dashboard tests.

It runs inside a test's network namespace (where the server's operator listener is) and
is driven over a pipe (``--remote-debugging-pipe``: fd 3 in, fd 4 out, one JSON message
per NUL), so no debugging port is opened anywhere. Its profile is a fresh directory, and
only the process started here is killed.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium")
READ_TIMEOUT = 60.0  # seconds for one DevTools answer (a busy 2-core machine, TCG beside)


class BrowserError(Exception):
    pass


def _above_4(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    def __init__(self, netns: str, profile: Path, log: Path, size: str = "1280,900") -> None:
        assert CHROMIUM, "chromium is not installed (vm-lab/setup.sh installs it)"
        to_browser, self._in = os.pipe()  # we write commands into fd 3 of chromium
        self._out, from_browser = os.pipe()  # it answers on its fd 4
        # above 4, so that moving one to 3 or 4 in the child cannot overwrite the other
        to_browser, from_browser = (_above_4(fd) for fd in (to_browser, from_browser))
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--no-default-browser-check", "--remote-debugging-pipe",
                 f"--user-data-dir={profile}", f"--window-size={size}", "about:blank"]  # fmt: skip
        shell = f'exec "$@" 3<&{to_browser} 4>&{from_browser}'
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", netns, "bash", "-c", shell, "chromium", CHROMIUM, *flags],
                pass_fds=(to_browser, from_browser), stdout=out, stderr=out,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._id = 0
        self.console: list[str] = []  # the page's console messages and exceptions
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            attached = self.call("Target.attachToTarget", targetId=target, flatten=True)
            self.session = attached["sessionId"]
            self.call("Page.enable", session=self.session)
            self.call("Runtime.enable", session=self.session)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._in, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + READ_TIMEOUT
        while True:
            answer = self._next(deadline, method)
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self._event(answer)

    def _next(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise BrowserError(f"no answer from chromium to {waiting_for} in {READ_TIMEOUT} s")
            chunk = os.read(self._out, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium exited (waiting for {waiting_for})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def _event(self, event: dict[str, Any]) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(a.get("value", a.get("description")))
                                         for a in params.get("args", [])))  # fmt: skip
        elif event.get("method") == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console.append(f"exception: {details.get('exception', {}).get('description')}")

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=self.session, url=url)

    def js(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", session=self.session, expression=expression,
                           awaitPromise=True, returnByValue=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float, what: str) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            with_errors = (
                f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()"
            )
            value = self.js(with_errors)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {what} in the dashboard after {timeout:g} s; page console: "
                    f"{self.console[-10:]}"
                )
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=self.session, format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        for fd in (self._in, self._out):
            os.close(fd)
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
        self.process.wait()

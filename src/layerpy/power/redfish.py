"""Redfish over plain aiohttp: the Python Redfish clients are synchronous or heavy.

Logs in with a session (``X-Auth-Token``) and falls back to basic auth when the BMC offers
no sessions; a token the BMC has expired is renewed once. The system is the address's
path when it names one, else the first member of ``/redfish/v1/Systems``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any

import aiohttp
from yarl import URL

from layerpy.power.base import PowerError, PowerSpec, scrub

TIMEOUT = 15.0  # seconds per request: real BMCs take seconds, more when busy or just reset
LOGOUT_WAIT = 2.0  # seconds close() waits for the BMC to confirm the end of the session
SESSIONS = "/redfish/v1/SessionService/Sessions"


class RedfishDriver:
    def __init__(self, node: str, spec: PowerSpec) -> None:
        assert spec.address
        url = URL(spec.address if "://" in spec.address else f"https://{spec.address}")
        if spec.port and url.explicit_port is None:
            url = url.with_port(spec.port)
        self.node = node
        self.spec = spec
        self.base = url.with_user(None).with_path("/")  # credentials come from the spec only
        self.where = str(self.base).rstrip("/")
        self.system_path = url.path.rstrip("/") or None
        self._http: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._session_uri: str | None = None
        self._logged_in = False

    async def status(self) -> str:
        return self._power_state(await self._system())

    async def on(self) -> None:
        """On and off are no-ops in the state asked for: some BMCs refuse them there."""
        system = await self._system()
        if self._power_state(system) == "off":
            await self._reset(system, "On")

    async def off(self) -> None:
        system = await self._system()
        if self._power_state(system) == "on":
            await self._reset(system, "ForceOff")

    async def cycle(self) -> None:
        """PowerCycle where the BMC offers it, else ForceRestart; On when off."""
        system = await self._system()
        if self._power_state(system) == "off":
            await self._reset(system, "On")
            return
        action = system.get("Actions", {}).get("#ComputerSystem.Reset", {})
        allowed = action.get("ResetType@Redfish.AllowableValues", [])
        await self._reset(system, "PowerCycle" if "PowerCycle" in allowed else "ForceRestart")

    async def boot_network_once(self) -> None:
        path = await self._system_path()
        boot = {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}
        await self._request("PATCH", path, {"Boot": boot})

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is None:
            return
        if self._session_uri:
            with contextlib.suppress(PowerError, TimeoutError):  # else the BMC expires it
                async with asyncio.timeout(LOGOUT_WAIT):
                    await self._request("DELETE", self._session_uri, http=http)
        self._token = self._session_uri = None
        self._logged_in = False
        await http.close()

    async def _system_path(self) -> str:
        if self.system_path is None:
            members = (await self._request("GET", "/redfish/v1/Systems"))["Members"]
            if not members:
                raise PowerError(f"{self.node}: BMC {self.where} lists no systems")
            self.system_path = members[0]["@odata.id"]
        return self.system_path

    async def _system(self) -> dict[str, Any]:
        return await self._request("GET", await self._system_path())

    def _power_state(self, system: dict[str, Any]) -> str:
        """PowerState as "on" or "off"; a transition counts as where it leads."""
        state = system.get("PowerState")
        if state in ("On", "PoweringOn", "Paused"):
            return "on"
        if state in ("Off", "PoweringOff"):
            return "off"
        raise PowerError(f"{self.node}: BMC {self.where}: unknown PowerState {state!r}")

    async def _reset(self, system: dict[str, Any], reset_type: str) -> None:
        action = system.get("Actions", {}).get("#ComputerSystem.Reset", {})
        target = action.get("target", f"{system['@odata.id']}/Actions/ComputerSystem.Reset")
        await self._request("POST", target, {"ResetType": reset_type})

    async def _login(self, http: aiohttp.ClientSession) -> None:
        """A session token if the BMC gives one, else basic auth on every request."""
        body = {"UserName": self.spec.user or "", "Password": self.spec.password or ""}
        try:
            async with http.post(self.base.with_path(SESSIONS), json=body) as response:
                if response.status == 401:
                    reason = "login refused: wrong user or password"
                    raise PowerError(f"{self.node}: BMC {self.where}: {reason}")
                self._token = response.headers.get("X-Auth-Token") if response.ok else None
                if self._token:
                    self._session_uri = response.headers.get("Location")
            self._logged_in = True
        except (aiohttp.ClientError, TimeoutError) as error:
            raise self._failure(error) from None

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        http: aiohttp.ClientSession | None = None,
    ) -> dict[str, Any]:
        """One call as JSON ({} for none), logging in again once if the token expired."""
        http = http or self._client()
        if not self._logged_in:
            await self._login(http)
        status, reason, text = await self._send(http, method, path, body)
        if status == 401 and self._token:
            await self._login(http)
            status, reason, text = await self._send(http, method, path, body)
        if status >= 400:
            where = f"{self.node}: BMC {self.where}: {method} {path}"
            raise PowerError(f"{where}: {status} {reason}{_message(text)}")
        return _json(text)

    async def _send(
        self, http: aiohttp.ClientSession, method: str, path: str, body: dict[str, Any] | None
    ) -> tuple[int, str, str]:
        headers = {"X-Auth-Token": self._token} if self._token else {}
        auth = None
        if not self._token:
            auth = aiohttp.BasicAuth(self.spec.user or "", self.spec.password or "")
        url = self.base.join(URL(path))
        try:
            async with http.request(method, url, json=body, headers=headers, auth=auth) as reply:
                return reply.status, reply.reason or "", await reply.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            raise self._failure(error) from None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TIMEOUT),
                connector=aiohttp.TCPConnector(ssl=self.spec.verify_tls),
            )
        return self._http

    def _failure(self, error: BaseException) -> PowerError:
        if isinstance(error, aiohttp.ClientConnectorCertificateError):
            reason = f": certificate not trusted ({error.certificate_error})"
            reason += "; verify_tls = false accepts a self-signed BMC"
        elif isinstance(error, TimeoutError):
            reason = f" unreachable (no answer in {TIMEOUT:g} s)"
        elif isinstance(error, aiohttp.ClientConnectorError):
            errno = error.os_error.errno
            reason = f" unreachable ({os.strerror(errno) if errno else error.os_error})"
        else:
            reason = f": {type(error).__name__}: {error}"
        return PowerError(f"{self.node}: BMC {self.where}{scrub(reason, self.spec.password)}")


def _json(text: str) -> dict[str, Any]:
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}


def _message(text: str) -> str:
    """The first message of a Redfish error body, as ": message", or nothing."""
    error = _json(text).get("error", {})
    infos = error.get("@Message.ExtendedInfo") or [{}]
    message = infos[0].get("Message") or error.get("message")
    return f": {message}" if message else ""

"""RPCRunner: measures on a machine reached through a TVM RPC tracker and key.

The remote side is ``partune rpc-server``: a TVM RPC server whose process has
Partune's measuring function registered (Python backends must live in the server
process), so a session can call it by name.
"""

from __future__ import annotations

import json
import signal
import socket
import time

from partune.core import FINGERPRINT_DIGITS, PartuneError, digest, last_line
from partune.runners import module_file
from partune.runners.protocol import ErrorReply, Reply, Request, reply_from_json
from partune.runners.runner import Runner

MEASURE_FUNC = "partune.measure"
DEVICE_FUNC = "partune.device_fingerprint"
RETRY_PAUSE_S = 2.0


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise PartuneError(f"bad address '{text}': expected HOST:PORT")
    return host, int(port)


class RPCRunner(Runner):
    def __init__(
        self, tracker: str, key: str, timeout_s: float = 120.0, threads: int = 1, attempts: int = 2
    ) -> None:
        import tvm.rpc

        self.host, self.port = parse_address(tracker)
        self.key, self.timeout_s, self.threads = key, timeout_s, threads
        self._device: str | None = None
        self.attempts = attempts
        try:
            socket.create_connection((self.host, self.port), timeout=5).close()  # fail fast
            self._tracker = tvm.rpc.connect_tracker(self.host, self.port)
            summary = self._tracker.summary()
        except Exception as e:  # noqa: BLE001 - socket and TVM errors alike
            raise PartuneError(
                f"cannot reach RPC tracker {tracker}: {str(e).splitlines()[0][:120]}"
            ) from e
        free = [s for s in summary.get("queue_info", {}) if s == key]
        servers = [s for s in summary.get("server_info", []) if s.get("key", "").endswith(key)]
        if not free and not servers:
            raise PartuneError(f"RPC tracker {tracker} has no server with key '{key}'")

    def device(self) -> str:
        """The servers' own fingerprint (their CPU, cores and library versions, not this
        machine's) joined with the key: devices under other keys keep their measurements apart."""
        if self._device is None:
            try:
                sess = self._tracker.request(self.key, priority=1, session_timeout=self.timeout_s)
                remote = str(sess.get_function(DEVICE_FUNC)(self.threads))
            except Exception as e:  # noqa: BLE001 - socket and TVM errors alike
                raise PartuneError(
                    f"RPC device '{self.key}' did not say what it is "
                    f"(an older partune rpc-server?): {last_line(e, 120)}"
                ) from e
            self._device = digest(
                {"rpc_key": self.key, "device": remote}, FINGERPRINT_DIGITS, sort_keys=True
            )
        return self._device

    def exchange(self, request: Request, timeout_s: float | None = None) -> Reply:
        """The request as JSON text through a server's ``handle_json``; its reply read back.

        A session that breaks (the server died, the network went) is tried again, on
        whichever server the tracker hands out next: a lost device costs time, not a
        candidate. A request that breaks every time is a failure of its own (a kernel that
        kills the server that runs it costs that one candidate); one that timed out is not
        tried again. A model that a local worker would read from a file travels as text."""
        request = module_file.inlined(self.addressed(request))
        text = json.dumps(request.to_json())
        why = ""
        for attempt in range(self.attempts):
            if attempt:
                time.sleep(RETRY_PAUSE_S)  # the tracker notices a dead server in about a second
            try:
                sess = self._tracker.request(
                    self.key, priority=1, session_timeout=timeout_s or self.timeout_s
                )
                return reply_from_json(json.loads(sess.get_function(MEASURE_FUNC)(text)))
            except Exception as e:  # noqa: BLE001 - socket and TVM errors alike
                why = last_line(e, 200)
                if "timeout" in why.lower() or "timed out" in why.lower():
                    break  # a hang: trying it again would only hang again
        return ErrorReply(
            f"rpc: {why}" + (f" ({self.attempts} attempts)" if self.attempts > 1 else "")
        )


def _register_in_server() -> None:
    """Runs inside the RPC server process: make the measuring function callable by name."""
    import warnings

    import tvm

    warnings.filterwarnings("ignore")
    from partune.runners.worker import handle_json

    tvm.register_global_func(MEASURE_FUNC, handle_json, override=True)
    tvm.register_global_func(DEVICE_FUNC, _server_device, override=True)


def _server_device(threads: int) -> str:
    from partune.core import device_fingerprint

    return device_fingerprint(int(threads))


def serve(
    tracker: str, key: str, host: str = "127.0.0.1", port: int = 9190, port_end: int = 9290
) -> None:
    """Start a measuring RPC server registered with ``tracker`` under ``key``; block."""
    import tvm.rpc

    tracker_addr = parse_address(tracker)
    server = tvm.rpc.Server(
        host=host,
        port=port,
        port_end=port_end,
        tracker_addr=tracker_addr,
        key=key,
        server_init_callback=_register_in_server,
        silent=True,
    )
    print(
        f"partune rpc-server: {host}:{server.port} registered as '{key}' with {tracker}", flush=True
    )
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        server.terminate()

"""Entry point of a local measuring worker: length-prefixed JSON over stdin/stdout.

The same JSON as the RPC path (``partune.runners.protocol``), never pickle: a request cannot
make the worker run anything but the handler it names.

The parent owns the timeout: it kills the worker's process group when a reply is late,
so a kernel that hangs while holding the GIL cannot hang the search.

Each reply is followed by 16 bytes: the worker's resident size now and its peak over its
life (``<QQ``, bytes; 0 when unknown). The parent replaces a worker that has grown
(``LocalRunner``'s limits) and reports the peak. Above ``RSS_LIMIT_ENV`` the worker first
hands its freed heap back to the system, so that only memory it keeps counts.
"""

from __future__ import annotations

import os
import struct
import sys

CPUS_ENV = "PARTUNE_CPUS"  # "0" or "1,2,3": the cores this worker may run on (LocalRunner's cpus)
RSS_LIMIT_ENV = (
    "PARTUNE_RSS_LIMIT"  # bytes: above it after a request, trim before reporting the size
)


def main() -> None:
    cpus = os.environ.get(CPUS_ENV)
    if cpus:  # before any library starts a thread: threads inherit it
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):  # cores this machine does not lend: run unpinned
            pass
    # Keep the protocol channel private: anything printed by libraries goes to stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    proto_in = sys.stdin.buffer
    from partune.runners import memory
    from partune.runners.worker import handle_json

    limit = int(os.environ.get(RSS_LIMIT_ENV) or 0)
    proto_out.write(b"RDY!")  # imports done: the parent's clock for requests starts now
    proto_out.flush()
    while True:
        head = proto_in.read(4)
        if len(head) < 4:
            return
        data = handle_json(
            proto_in.read(struct.unpack("<I", head)[0]).decode(errors="replace")
        ).encode()
        rss = memory.resident_bytes() or 0
        if limit and rss > limit:
            memory.trim()
            rss = memory.resident_bytes() or 0
        sizes = struct.pack("<QQ", rss, memory.lifetime_peak_bytes() or 0)
        proto_out.write(struct.pack("<I", len(data)) + data + sizes)
        proto_out.flush()


if __name__ == "__main__":
    main()

"""Microseconds to build one streamed completion chunk (runtime/server/responses.py), the server's
per-token cost outside the engine.

    .venv/bin/python bench/sse_chunk.py [--chunks 20000]
"""

from __future__ import annotations

import argparse
import time

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.responses import Choice, ResponseShape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=20000)
    args = parser.parse_args()
    stream = ResponseShape("cmpl-bench", 0, "model", False, lambda token: "a").stream_for(
        Choice(0, 0, [1, 2, 3], SamplingParams())
    )
    output = RequestOutput("req", (5,), "hello", False, None)
    started = time.perf_counter()
    for _ in range(args.chunks):
        stream.chunks(output)
    print(f"{(time.perf_counter() - started) / args.chunks * 1e6:.1f} us per completion chunk")


if __name__ == "__main__":
    main()

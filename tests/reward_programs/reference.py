#!/usr/bin/env python3
"""A reward program that scores the reference answer it is given, for the tests of held-out
records that end with their answer (tests/test_rewards.py, tests/test_bench_rollouts.py).

    reference.py LOG

Each request (without the protocol's `_retrograd_*` fields) is appended to LOG as a JSON
line; the reward is the length of its "reference", or -1 when it has none. It speaks both
modes: persistent when the first line is the handshake, else one-shot.
"""

import json
import sys

HANDSHAKE = {"protocol": "retrograd-reward/1"}
ECHOED = ("_retrograd_batch", "_retrograd_index")


def main() -> None:
    log = open(sys.argv[1], "a", encoding="utf-8")
    for line in sys.stdin:
        request = json.loads(line)
        if request == HANDSHAKE or "_retrograd_batch_end" in request:
            reply = request
        else:
            log.write(json.dumps({k: v for k, v in request.items() if k not in ECHOED}) + "\n")
            log.flush()
            reference = request.get("reference")
            reply = {"reward": -1.0 if reference is None else float(len(reference))}
            reply |= {k: request[k] for k in ECHOED if k in request}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A reward program that breaks the protocol on purpose, for tests/test_rewards.py.

    misbehave.py BEHAVIOUR PIDFILE

It first spawns a grandchild (`sleep 60`, in the same process group, holding its stdout) and writes
"<own pid> <grandchild pid>" to PIDFILE, so that a test can check the whole group was killed.
"""

import json
import os
import subprocess
import sys
import time

HANDSHAKE = {"protocol": "retrograd-reward/1"}


def send(obj_or_text):
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def requests():
    return [json.loads(line) for line in sys.stdin if line.strip()]


def persistent(answer, after_batch_end=lambda: None):
    """Serve the persistent protocol, replying to each request with answer(request)."""
    for line in sys.stdin:
        request = json.loads(line)
        if request == HANDSHAKE or "_retrograd_batch_end" in request:
            send(request)
            if "_retrograd_batch_end" in request:
                after_batch_end()
            continue
        send(
            {
                "reward": answer(request),
                "_retrograd_batch": request["_retrograd_batch"],
                "_retrograd_index": request["_retrograd_index"],
            }
        )


def crash():
    sys.stdin.readline()
    sys.stderr.write("Traceback (most recent call last):\nmisbehave: crashing on purpose\n")
    sys.exit(3)


def hang():
    time.sleep(60)


def hang_after_handshake():
    send(json.loads(sys.stdin.readline()))
    time.sleep(60)


def oneshot_only():
    for _ in requests():
        send({"reward": 0.0})


def not_json():
    for _ in requests():
        send("hello")


def nan():
    for _ in requests():
        send('{"reward": NaN}')


def wrong_shape():
    for _ in requests():
        send({"score": 1})


def short():
    for _ in requests()[1:]:
        send({"reward": 1.0})


def extra_oneshot():
    for _ in requests():
        send({"reward": 1.0})
        send({"reward": 1.0})


def extra_persistent():
    persistent(lambda request: 1.0, after_batch_end=lambda: send({"reward": 0.5, "note": "extra"}))


def counter():
    """Reward = how many requests this worker has seen; a prompt "crash" kills it."""
    seen = []

    def count(request):
        if request["prompt"] == "crash":
            sys.exit(5)
        seen.append(request)
        return len(seen)

    persistent(count)


def big_output():
    """1 MiB of stderr before answering, and 2 MiB answer lines: neither may block the trainer."""
    sys.stderr.write("x" * 2**20 + "\n")
    sys.stderr.flush()
    for _ in requests():
        send('{"reward": 0.25' + " " * 2 * 2**20 + "}")


def huge_line():
    send('{"reward": 1' + " " * 9 * 2**20 + "}")
    requests()


if __name__ == "__main__":
    behaviour, pidfile = sys.argv[1], sys.argv[2]
    grandchild = subprocess.Popen(["sleep", "60"])
    with open(pidfile, "w") as file:
        file.write(f"{os.getpid()} {grandchild.pid}")
    globals()[behaviour]()

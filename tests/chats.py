"""Chat corpora the tests write: arithmetic sums a tiny model can be trained on."""

import json
import random
from pathlib import Path


def write_chat(path: Path, n: int, seed: int = 0) -> Path:
    """n records, user "What is A + B?", assistant "A+B=C", A and B drawn from Random(seed)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            msgs = [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": f"{a}+{b}={a + b}"},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path

"""A command judge for examples/agent (the [agent.judge] protocol, one-shot): reads one
{"prompt": ..., "completion": ...} JSON object per line and answers {"reward": r} per line,
in order. Scores the one scenario without `verify`: a short answer that says ls lists files."""

import json
import sys

for line in sys.stdin:
    completion = json.loads(line)["completion"].lower()
    on_topic = any(word in completion for word in ("list", "files", "director"))
    short = 100 / (100 + len(completion))  # 1 for an empty answer, 0.5 at 100 characters
    print(json.dumps({"reward": 0.5 * on_topic + 0.5 * short}), flush=True)

#!/usr/bin/env python3
"""Reference reward program for the GRPO smoke example: is the arithmetic right?

The prompt holds an expression with integer operands and up to two operators out of + - * / × ÷,
e.g. "Calculate 14 + 7. Reply with exactly one number." The reward is 1 / (1 + |answer - expected|),
where answer is the first integer in the completion; it is 0 when the completion holds no integer
(or the prompt no expression, or the expression divides by zero).

It speaks both modes of the retrograd-reward/1 protocol: when the first line is the handshake it is
echoed and requests carry `_retrograd_batch` / `_retrograd_index`, which are echoed, with
`{"_retrograd_batch_end": B}` echoed too; otherwise every line is a one-shot request. Each reply is
flushed, since in persistent mode stdin stays open. Standard library only.

    echo '{"prompt": "Calculate 14 + 7.", "completion": "20"}' | examples/smoke_rl_reward.py
    {"reward": 0.5}
"""

import json
import operator
import re
import sys
from fractions import Fraction

HANDSHAKE = {"protocol": "retrograd-reward/1"}
ECHOED = ("_retrograd_batch", "_retrograd_index")

_OPERATOR = r"\s*([-+*/×÷])\s*"
_EXPRESSION = re.compile(rf"(-?\d+){_OPERATOR}(-?\d+)(?:{_OPERATOR}(-?\d+))?")
_INTEGER = re.compile(r"-?\d+")
_APPLY = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "×": operator.mul,
    "/": operator.truediv,
    "÷": operator.truediv,
}
_BINDS_TIGHT = {"*", "×", "/", "÷"}


def expected_value(prompt):
    """The exact value (a Fraction) of the first expression in the prompt, or None."""
    match = _EXPRESSION.search(prompt)
    if match is None:
        return None
    a, first, b, second, c = match.groups()
    try:
        if second is None:
            return _APPLY[first](Fraction(a), Fraction(b))
        if second in _BINDS_TIGHT and first not in _BINDS_TIGHT:  # a + b * c
            return _APPLY[first](Fraction(a), _APPLY[second](Fraction(b), Fraction(c)))
        return _APPLY[second](_APPLY[first](Fraction(a), Fraction(b)), Fraction(c))  # left to right
    except ZeroDivisionError:
        return None


def reward(prompt, completion):
    expected = expected_value(prompt)
    answer = _INTEGER.search(completion)
    if expected is None or answer is None:
        return 0.0
    return float(1 / (1 + abs(int(answer.group()) - expected)))


def reply(request):
    if request == HANDSHAKE:
        return HANDSHAKE
    if "_retrograd_batch_end" in request:
        return {"_retrograd_batch_end": request["_retrograd_batch_end"]}
    answer = {"reward": reward(request["prompt"], request["completion"])}
    answer.update((key, request[key]) for key in ECHOED if key in request)
    return answer


def main():
    sys.stdin.reconfigure(encoding="utf-8")
    sys.stdout.reconfigure(encoding="utf-8")
    for line in sys.stdin:  # line by line: a persistent trainer waits for each answer
        if line.strip():
            print(json.dumps(reply(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()

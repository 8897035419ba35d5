"""An LLM judge over any OpenAI-compatible endpoint (`[grpo.judge]` / `[agent.judge]` with
type = "ruler"): verdicts in [0, 1] for the members of one group, relative to each other.

Strategies (`[...judge.strategy] mode`):
- listwise: one request shows the task and every member (ids in an order drawn from the
  group's content, so position bias does not follow a member) and asks for a score each;
- chunked: listwise over chunks that fit `max_request_chars`; with `anchor`, the first
  member sits in every chunk and each chunk's scores are shifted so it scores the same;
- pairwise: pairs in a ring (0,1), (1,2), ..., (n-1,0), then the others, up to `max_pairs`;
  with `both_orders` each pair is asked A-B and B-A, and answers that disagree count as a
  tie; members score their win rate (ties half) or a Bradley-Terry strength;
- auto: listwise, chunked when the request would be too long.
Replies are asked for under a JSON schema (`retrograd serve` and most servers enforce it;
one that refuses `response_format` gets plain JSON mode on the next try), then checked:
every id once, every score a number in [0, 1]. A failed request is retried `max_retries`
times; then the group fails (JudgeError) and the run drops it or stops, as configured.

Verdicts are cached by content (model, messages, format, temperature) in `cache_path`, one
JSON line each, so a rerun of the same requests asks nothing. Texts over their character
budget keep `head_ratio` of it from the start and the rest from the end.

An agent's transcript comes as its parts (the assistant turns, then the environment's
state). With `[...judge.compaction]`, a group whose longest member is over `trigger_chars`
has each member's parts but the last `keep_last` replaced by a summary of at most
`target_chars`, written by the judge's model at temperature 0 (so cached and repeatable);
the verdict then reads the summary and the last parts as they were.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from retrograd.config import JudgeCompactionSection, JudgeContextSection, JudgeSection, JudgeStrategySection
from retrograd.rollouts.rewards import RewardError

RUBRIC = (
    "Judge how well each response completes the task: correct, complete and following every instruction "
    "in the task. A response that is wrong or ignores the task scores near 0; one that fully and "
    "correctly does what was asked scores near 1. Score the responses relative to each other."
)
PAIRWISE_RUBRIC = (
    "Decide which of the two responses completes the task better: correct, complete and following every "
    "instruction in the task. Answer tie only when neither is better."
)
EXPLANATION_CHARS = 200  # per verdict, bounded so a small judge cannot run on
COMPACTION = (
    "You shorten an agent's transcript for a grader who will judge the agent's work. Summarize the earlier "
    "turns below in at most {chars} characters: what the agent tried, what it learned from its tools, the "
    "errors it met and anything its later turns rely on. Report; do not judge."
)
SCORES = [k / 10 for k in range(11)]  # listwise scores a schema can enforce (it has no numeric bounds)


class JudgeError(RewardError):
    """The judge gave no usable verdict for a group, retries included."""


def elide(text: str, budget: int, head_ratio: float) -> str:
    """`text` within `budget` characters: its head and tail around a note of what was left out."""
    if len(text) <= budget:
        return text
    note = "\n[... {} characters left out ...]\n"
    keep = max(budget - len(note.format(len(text))), 0)
    head = int(keep * head_ratio)
    tail = keep - head
    return text[:head] + note.format(len(text) - keep) + (text[len(text) - tail :] if tail else "")


class RulerJudge:
    """Scores groups through `section`'s endpoint; thread-safe (groups may be judged in parallel)."""

    def __init__(self, section: JudgeSection):
        self.s = section
        self.strategy = section.strategy or JudgeStrategySection()
        self.context = section.context or JudgeContextSection()
        key = os.environ.get(section.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=section.base_url.rstrip("/"), headers=headers, timeout=section.timeout)
        self.requests = threading.Semaphore(section.max_concurrency)
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.plain_json = False  # the endpoint refused a JSON schema once: ask for plain JSON from then on
        self.cache: dict[str, Any] = {}
        if section.cache_path is not None and section.cache_path.exists():
            for line in section.cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.cache[entry["key"]] = entry["verdict"]
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from an interrupted run

    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        """Counters since the last call: requests, cache hits, position disagreements, and the
        share of judged members whose transcript was compacted."""
        with self.lock:
            c, self.counts = self.counts, Counter()
        asked = c["requests"] + c["cache_hits"]
        out = {"judge/requests": float(c["requests"]), "judge/cache_hit_rate": c["cache_hits"] / asked if asked else 0.0}
        if c["pair_checks"]:
            out["judge/position_disagreement"] = c["disagreements"] / c["pair_checks"]
        if self.s.compaction is not None:
            out["judge/compacted_fraction"] = c["compacted"] / c["members"] if c["members"] else 0.0
        return out

    # ---- one group

    def score_group(self, prompt: str, completions: list[str | tuple[str, ...]], rubric: str | None = None) -> list[float]:
        """Verdicts in [0, 1], one per completion (a text, or a transcript's parts); JudgeError
        when the judge fails."""
        if not completions:
            return []
        task = elide(prompt, self.context.max_message_chars, self.context.head_ratio)
        parts = [(c,) if isinstance(c, str) else tuple(c) for c in completions]
        budget = min(self.context.max_trajectory_chars, self.context.max_message_chars)
        texts = [elide(text, budget, self.context.head_ratio) for text in self._compacted(task, parts)]
        if len(texts) == 1:
            return self._listwise(task, texts, rubric)  # nothing to compare with: an absolute score
        mode = self.strategy.mode
        if mode == "pairwise":
            return self._pairwise(task, texts, rubric)
        if mode == "listwise" or (mode == "auto" and self._fits(task, texts)):
            return self._listwise(task, texts, rubric)
        return self._chunked(task, texts, rubric)

    def _compacted(self, task: str, parts: list[tuple[str, ...]]) -> list[str]:
        """Each transcript as the judge reads it: its parts joined, or, when compaction applies
        to the group (its longest member is over trigger_chars), a summary of the parts but
        the last keep_last, then those."""
        whole = ["\n".join(p) for p in parts]
        k: JudgeCompactionSection | None = self.s.compaction
        with self.lock:
            self.counts["members"] += len(parts)
        if k is None or max(map(len, whole)) <= k.trigger_chars:
            return whole
        out = []
        for p, text in zip(parts, whole):
            if len(p) <= k.keep_last:
                out.append(text)
                continue
            summary = self._summary(task, "\n".join(p[: -k.keep_last]), k.target_chars)
            out.append("\n".join([f"[summary of the earlier turns]\n{summary}", "[the last turns]", *p[-k.keep_last:]]))
            with self.lock:
                self.counts["compacted"] += 1
        return out

    def _summary(self, task: str, earlier: str, chars: int) -> str:
        room = max(self.context.max_request_chars - len(task) - 1000, 1000)
        user = f"Task:\n{task}\n\nEarlier turns:\n{elide(earlier, room, self.context.head_ratio)}"
        schema = {"type": "object", "required": ["summary"], "properties": {"summary": {"type": "string", "maxLength": chars}}}

        def read(reply: Any) -> str:
            summary = reply.get("summary") if isinstance(reply, dict) else None
            if not isinstance(summary, str) or not summary.strip():
                raise ValueError('no "summary" string')
            return elide(summary.strip(), chars, self.context.head_ratio)  # plain JSON mode has no maxLength

        return self._ask(COMPACTION.format(chars=chars), user, schema, read, temperature=0.0)

    def _fits(self, task: str, texts: list[str]) -> bool:
        return len(task) + sum(len(t) + 40 for t in texts) + len(self.s.rubric or RUBRIC) + 400 <= self.context.max_request_chars

    def _listwise(self, task: str, texts: list[str], rubric: str | None) -> list[float]:
        order = np.random.default_rng(_seed(task, texts)).permutation(len(texts))  # shown position -> member
        ids = [str(k + 1) for k in range(len(texts))]
        shown = "\n\n".join(f"[response {ids[k]}]\n{texts[member]}" for k, member in enumerate(order))
        system = (f"{rubric or self.s.rubric or RUBRIC}\n\nReply with JSON: for every response its id, a short "
                  "explanation and a score from 0 to 1 in steps of 0.1.")
        user = f"Task:\n{task}\n\nResponses:\n\n{shown}"
        item = {"type": "object", "required": ["id", "explanation", "score"],
                "properties": {"id": {"enum": ids}, "explanation": {"type": "string", "maxLength": EXPLANATION_CHARS},
                               "score": {"enum": SCORES}}}
        schema = {"type": "object", "required": ["scores"],
                  "properties": {"scores": {"type": "array", "items": item, "minItems": len(ids), "maxItems": len(ids)}}}

        def read(reply: Any) -> list[float]:
            entries = reply.get("scores") if isinstance(reply, dict) else None
            if not isinstance(entries, list):
                raise ValueError('no "scores" list')  # (plain JSON mode may give any score in [0, 1])
            got = {}
            for entry in entries:
                if not isinstance(entry, dict) or str(entry.get("id")) not in ids or str(entry["id"]) in got:
                    raise ValueError(f"an unknown or repeated id in {str(entry)[:80]}")
                score = entry.get("score")
                if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
                    raise ValueError(f"score {score!r} is not a number in [0, 1]")
                got[str(entry["id"])] = float(score)
            if len(got) != len(ids):
                raise ValueError(f"{len(got)} of {len(ids)} responses scored")
            scores = [0.0] * len(texts)
            for k, member in enumerate(order):
                scores[member] = got[ids[k]]
            return scores

        return self._ask(system, user, schema, read)

    def _chunked(self, task: str, texts: list[str], rubric: str | None) -> list[float]:
        anchor = self.strategy.anchor
        rest = list(range(1, len(texts))) if anchor else list(range(len(texts)))
        chunks: list[list[int]] = []
        for k in rest:
            head = [0] if anchor else []
            if chunks and self._fits(task, [texts[i] for i in chunks[-1] + [k]]):
                chunks[-1].append(k)
            else:
                chunks.append(head + [k])
        scores = [0.0] * len(texts)
        first_anchor = None
        for chunk in chunks:
            got = self._listwise(task, [texts[i] for i in chunk], rubric)
            shift = 0.0
            if anchor:
                first_anchor = got[0] if first_anchor is None else first_anchor
                shift = first_anchor - got[0]
                scores[0] = first_anchor
            for i, score in zip(chunk, got):
                if not (anchor and i == 0):
                    scores[i] = min(max(score + shift, 0.0), 1.0)
        return scores

    def _pairwise(self, task: str, texts: list[str], rubric: str | None) -> list[float]:
        n = len(texts)
        ring = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, 1)]
        others = [p for p in itertools.combinations(range(n), 2) if p not in ring and p[::-1] not in ring]
        limit = max(self.strategy.max_pairs or len(ring) + len(others), n if n > 2 else 1)
        pairs = (ring + others)[:limit]
        asks = [(i, j) for i, j in pairs] + ([(j, i) for i, j in pairs] if self.strategy.both_orders else [])
        with ThreadPoolExecutor(self.s.max_concurrency) as pool:
            answers = dict(zip(asks, pool.map(lambda pair: self._compare(task, texts, *pair, rubric), asks)))
        wins = np.zeros((n, n))  # wins[i, j]: i beat j (a tie is half a win each)
        for i, j in pairs:
            outcome = answers[(i, j)]
            if self.strategy.both_orders:
                reverse = answers[(j, i)]  # asked with j shown first: "A" means j
                flipped = {"A": "B", "B": "A", "tie": "tie"}[reverse]
                with self.lock:
                    self.counts["pair_checks"] += 1
                    self.counts["disagreements"] += outcome != flipped
                outcome = outcome if outcome == flipped else "tie"
            wins[i, j] += {"A": 1.0, "B": 0.0, "tie": 0.5}[outcome]
            wins[j, i] += {"A": 0.0, "B": 1.0, "tie": 0.5}[outcome]
        if self.strategy.aggregation == "bradley_terry":
            return bradley_terry(wins)
        games = wins + wins.T
        return [float(wins[i].sum() / games[i].sum()) if games[i].sum() else 0.5 for i in range(n)]

    def _compare(self, task: str, texts: list[str], first: int, second: int, rubric: str | None) -> str:
        system = (f"{rubric or self.s.pairwise_rubric or PAIRWISE_RUBRIC}\n\nReply with JSON: a short explanation, "
                  'then the winner: "A", "B" or "tie".')
        user = f"Task:\n{task}\n\n[response A]\n{texts[first]}\n\n[response B]\n{texts[second]}"
        schema = {"type": "object", "required": ["explanation", "winner"],
                  "properties": {"explanation": {"type": "string", "maxLength": EXPLANATION_CHARS},
                                 "winner": {"enum": ["A", "B", "tie"]}}}

        def read(reply: Any) -> str:
            winner = reply.get("winner") if isinstance(reply, dict) else None
            if winner not in ("A", "B", "tie"):
                raise ValueError(f"winner {winner!r} is not A, B or tie")
            return winner

        return self._ask(system, user, schema, read)

    # ---- one request

    def _ask(self, system: str, user: str, schema: dict, read, temperature: float | None = None):
        """read(the reply's JSON), from the cache or the endpoint, with retries (at the judge's
        temperature unless told)."""
        problem = ""
        temperature = self.s.temperature if temperature is None else temperature
        for attempt in range(self.s.max_retries + 1):
            body = {"model": self.s.model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "response_format": ({"type": "json_object"} if self.plain_json else
                                        {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})}
            if temperature is not None:
                body["temperature"] = temperature
            key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            with self.lock:
                cached = self.cache.get(key)
            if cached is not None:
                with self.lock:
                    self.counts["cache_hits"] += 1
                return read(cached)
            try:
                with self.requests:
                    response = self.client.post("/chat/completions", json=body)
                with self.lock:
                    self.counts["requests"] += 1
                if response.status_code == 400 and not self.plain_json and "response_format" in response.text:
                    self.plain_json, problem = True, "the endpoint refused a JSON schema"
                    continue
                response.raise_for_status()
                reply = json.loads(response.json()["choices"][0]["message"]["content"])
                verdict = read(reply)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                problem = f"{type(e).__name__}: {e}"[:300]
                continue
            self._remember(key, reply)
            return verdict
        raise JudgeError(f"the judge at {self.s.base_url} gave no usable verdict in {self.s.max_retries + 1} tries "
                         f"(last: {problem})")

    def _remember(self, key: str, reply: Any) -> None:
        with self.lock:
            self.cache[key] = reply
            if self.s.cache_path is not None:
                self.s.cache_path.parent.mkdir(parents=True, exist_ok=True)
                with self.s.cache_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"key": key, "verdict": reply}, ensure_ascii=False) + "\n")


def bradley_terry(wins: np.ndarray, iterations: int = 200) -> list[float]:
    """Scores in (0, 1) from a win matrix: Bradley-Terry strengths (Hunter's MM updates), each
    member also given one win and one loss against a virtual opponent of strength 1 so that a
    member that won or lost everything stays finite; the score is the win probability against
    that opponent."""
    n = len(wins)
    games = wins + wins.T
    strength = np.ones(n)
    for _ in range(iterations):
        denominator = (games / (strength[:, None] + strength[None, :])).sum(axis=1) + 2.0 / (strength + 1.0)
        strength = (wins.sum(axis=1) + 1.0) / denominator
    return [float(s / (s + 1.0)) for s in strength]


def _seed(task: str, texts: list[str]) -> int:
    digest = hashlib.sha256(json.dumps([task, texts]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def make_judge(section: JudgeSection):
    """The judge `section` describes: a RulerJudge, or the command (one process per group)."""
    if section.type == "ruler":
        return RulerJudge(section)
    from retrograd.rollouts.rewards import OneshotCommandReward

    return OneshotCommandReward(section.command, section.timeout)


def judge_group(judge, prompt: str, completions: list[str | tuple[str, ...]], rubric: str | None = None) -> list[float]:
    """One group's verdicts from either kind of judge (a command sees no rubric, and a
    transcript's parts joined by newlines)."""
    if isinstance(judge, RulerJudge):
        return judge.score_group(prompt, completions, rubric)
    return judge.score([prompt] * len(completions), [c if isinstance(c, str) else "\n".join(c) for c in completions])

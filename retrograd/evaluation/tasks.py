"""`retrograd eval`: did a fine-tune help, and what did it break? Small local tasks scored
exactly by the torch forward, base and each adapter on the same items, each difference
with a paired bootstrap interval and a verdict.

A task is a JSONL file (a folder: each *.jsonl in it, named by stem). Records:
- multiple choice: {"question", "choices": [...], "answer": index or the choice's text}. The
  question is the context and " " + choice the continuation (lm-evaluation-harness's split);
  the pick is the choice with the highest summed log-prob ("accuracy") or the highest
  log-prob per character ("accuracy (length-normalised)"). A question's choices share its
  prompt, packed and computed once.
- perplexity: {"text"}: every token after the first is scored; the item's score is its mean
  log-prob per token, the task's perplexity exp(total NLL / tokens).
- generation: a prompts file as training reads one ({"prompt"}, or {"messages"} ending with a
  user turn, optionally then the reference answer, which the reward receives): llama.cpp
  answers each prompt `samples` times, with the same seeds for every model, and a reward
  program (the reward protocol, or a Python function) scores the answers; the item's score is
  its mean reward.
Each item's score (correct or not, mean log-prob, mean reward) is paired across models; the difference
adapter - base is resampled over items (BOOTSTRAP_SAMPLES, a fixed seed) for a 95% interval:
better when it lies above 0, worse below, otherwise no detectable change.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrograd.data import ChatFormat, completion_seed, load_prompts
from retrograd.errors import DataError
from retrograd.gguf.adapter import read_fitting_adapter
from retrograd.gguf.file import GGUFFile
from retrograd.model.tokenizer import Tokenizer
from retrograd.sampler import GroupRequest, Sampler, SamplerOptions, Sampling
from retrograd.training.batches import LogprobOptions
from retrograd.training.scoring import Rollout, rollout_logprobs

BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Choice:
    question: str
    choices: tuple[str, ...]
    answer: int
    source: str  # file:line


@dataclass(frozen=True)
class Text:
    text: str
    source: str


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "multiple_choice" | "perplexity" | "generation"
    items: tuple  # Choice, Text or data.Prompt records


def load_tasks(path: Path, chat: ChatFormat) -> tuple[Task, ...]:
    """A JSONL file, or every *.jsonl of a folder; each one task of one kind of record.
    `chat` (the model's tokenizer and template) renders generation prompts."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise DataError(f"--tasks {path}: {'no *.jsonl files in this folder' if path.is_dir() else 'no such file'}")
    return tuple(_task(f, chat) for f in files)


def _task(path: Path, chat: ChatFormat) -> Task:
    items, kinds = [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    first = next((line for line in lines if line.strip()), None)
    try:
        opening = json.loads(first) if first is not None else None
    except ValueError:
        opening = None  # reported with its line below
    if isinstance(opening, dict) and ("prompt" in opening or "messages" in opening):
        return Task(path.stem, "generation", tuple(load_prompts(path, chat, evaluation=True)))
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{where}: not a JSON object ({e})") from None
        item = _item(record, where)
        kinds.add(type(item))
        items.append(item)
    if not items:
        raise DataError(f"{path}: no records")
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes multiple-choice and text records; put each kind in a file of its own")
    return Task(path.stem, "multiple_choice" if kinds == {Choice} else "perplexity", tuple(items))


def _item(record, where: str) -> Choice | Text:
    if isinstance(record, dict) and set(record) >= {"question", "choices", "answer"}:
        q, choices, answer = record["question"], record["choices"], record["answer"]
        if not (isinstance(q, str) and q and isinstance(choices, list) and len(choices) >= 2
                and all(isinstance(c, str) and c for c in choices)):
            raise DataError(f"{where}: expected \"question\": a non-empty string and \"choices\": two or more non-empty strings")
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise DataError(f"{where}: \"answer\" = {answer!r}: expected an index into choices or one of their texts")
        return Choice(q, tuple(choices), answer, where)
    if isinstance(record, dict) and "text" in record:
        if not (isinstance(record["text"], str) and record["text"].strip()):
            raise DataError(f"{where}: \"text\" must be a non-empty string")
        return Text(record["text"], where)
    raise DataError(f"{where}: expected a multiple-choice record {{\"question\", \"choices\", \"answer\"}}, "
                    "a text record {\"text\"} or a generation record {\"prompt\"} / {\"messages\"}")


# ---------------------------------------------------------------- scoring


def choice_rollouts(tokenizer: Tokenizer, items: tuple[Choice, ...]) -> list[Rollout]:
    """One rollout per (question, choice): the question's tokens as the shared prompt, the
    rest of question + " " + choice as the scored continuation."""
    rollouts = []
    for i, item in enumerate(items):
        context = tokenizer.encode(item.question)
        for choice in item.choices:
            whole = tokenizer.encode(item.question + " " + choice)
            rest = whole[len(context):] if whole[: len(context)] == context else tokenizer.encode(" " + choice, add_bos=False)
            rollouts.append(Rollout(i, tuple(context), tuple(rest)))
    return rollouts


def text_rollouts(tokenizer: Tokenizer, items: tuple[Text, ...]) -> list[Rollout]:
    rollouts = []
    for i, item in enumerate(items):
        ids = tokenizer.encode(item.text)
        if len(ids) < 2:
            raise DataError(f"{item.source}: the text is a single token; nothing to score")
        rollouts.append(Rollout(i, tuple(ids[:1]), tuple(ids[1:])))
    return rollouts


@dataclass(frozen=True)
class Scores:
    """One model's pass over one task: per-item scores (higher is better) and the task's metrics."""

    items: np.ndarray  # [n] correct (0/1) or mean log-prob per token
    metrics: dict[str, float]
    detail: list  # per item: the choices' summed log-probs, or (NLL, tokens)


def score_task(model, task: Task, micro_batch: int, device, progress: Callable[[int], None]) -> Scores:
    """Every item of `task` under `model` (a BaseModel, adapter attached or not), batched
    `micro_batch` tokens at a time with each question's prompt packed once."""
    tokenizer = model.tokenizer
    make = choice_rollouts if task.kind == "multiple_choice" else text_rollouts
    rollouts = make(tokenizer, task.items)
    logps = []
    for start in range(0, len(rollouts), 64):  # chunks, so the bar moves
        chunk = rollouts[start : start + 64]
        logps += rollout_logprobs(model.transformer, chunk, LogprobOptions(), micro_batch, device)
        progress(len(chunk))
    sums = [float(lp.double().sum()) for lp in logps]
    if task.kind == "perplexity":
        counts = [len(r.tokens) for r in rollouts]
        total = sum(counts)
        return Scores(np.array([s / n for s, n in zip(sums, counts)]),
                      {"perplexity": float(np.exp(-sum(sums) / total)), "mean log-prob per token": sum(sums) / total},
                      [(-s, n) for s, n in zip(sums, counts)])
    correct, normalised, detail, k = [], [], [], 0
    for item in task.items:
        mine = sums[k : k + len(item.choices)]
        k += len(item.choices)
        per_char = [s / len(" " + c) for s, c in zip(mine, item.choices)]
        correct.append(float(int(np.argmax(mine)) == item.answer))
        normalised.append(float(int(np.argmax(per_char)) == item.answer))
        detail.append(mine)
    return Scores(np.array(correct), {"accuracy": float(np.mean(correct)),
                                      "accuracy (length-normalised)": float(np.mean(normalised))}, detail)


@dataclass(frozen=True)
class Answering:
    """How generation tasks are answered and scored: llama.cpp samples `samples` answers per
    prompt (the same seeds for every model, so the comparison is paired) and `reward` (made
    by rollouts.rewards.make_reward, entered by the caller) scores them."""

    reward: object
    sampling: Sampling
    samples: int = 1
    seed: int = 0


class Answerer:
    """The llama.cpp sampler on the base, switching adapters, answering generation tasks."""

    def __init__(self, sampler: Sampler, base: Path, answering: Answering, tokenizer: Tokenizer):
        self.sampler, self.base, self.answering, self.tokenizer = sampler, base, answering, tokenizer

    def score(self, adapter: Path | None, task: Task, progress: Callable[[int], None]) -> Scores:
        a = self.answering
        if adapter is None:
            self.sampler.set_adapter(None)
        else:
            loaded = read_fitting_adapter(adapter, GGUFFile(self.base))
            self.sampler.set_adapter(loaded.tensors, alpha=loaded.alpha)
        eog, tokenizer = self.sampler.eog_ids, self.tokenizer
        per_call = max(1, self.sampler.options.n_seq_max // a.samples)
        rewards, texts = [], []
        for start in range(0, len(task.items), per_call):
            chunk = task.items[start : start + per_call]
            requests = [GroupRequest(p.ids, [completion_seed(a.seed, start + i, j) for j in range(a.samples)], a.sampling)
                        for i, p in enumerate(chunk)]
            answers = [tokenizer.decode([t for t in c.tokens if t not in eog], special=False)
                       for group in self.sampler.generate(requests) for c in group]
            scored = a.reward.score([p.text for p in chunk for _ in range(a.samples)], answers,
                                    [p.reference for p in chunk for _ in range(a.samples)])
            rewards += [scored[i * a.samples : (i + 1) * a.samples] for i in range(len(chunk))]
            texts += [answers[i * a.samples : (i + 1) * a.samples] for i in range(len(chunk))]
            progress(len(chunk) * a.samples)
        means = np.array([np.mean(r) for r in rewards])
        return Scores(means, {"mean reward": float(means.mean())},
                      [{"rewards": r, "answers": t} for r, t in zip(rewards, texts)])


@contextmanager
def open_answerer(base: Path, tasks: tuple[Task, ...], answering: Answering | None, tokenizer: Tokenizer):
    """An Answerer when any task is a generation task (None otherwise), closed afterwards."""
    generation = [t for t in tasks if t.kind == "generation"]
    if not generation:
        yield None
        return
    if answering is None:
        raise DataError(f"{generation[0].name}: a generation task needs a reward program to score its answers "
                        "(retrograd eval --reward-function module:function or --reward-command CMD)")
    longest = max(len(p.ids) for t in generation for p in t.items)
    options = SamplerOptions(n_ctx=longest + answering.sampling.max_new_tokens, n_seq_max=max(8, answering.samples))
    with Sampler(base, options) as sampler:
        yield Answerer(sampler, base, answering, tokenizer)


def n_rollouts(task: Task, samples: int = 1) -> int:
    if task.kind == "generation":
        return len(task.items) * samples
    return sum(len(i.choices) for i in task.items) if task.kind == "multiple_choice" else len(task.items)


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Difference:
    mean: float  # adapter - base, over items (higher is better)
    low: float
    high: float
    verdict: str  # "better" | "worse" | "no detectable change"


def paired_difference(base: np.ndarray, other: np.ndarray, seed: int = 0) -> Difference:
    """The mean of other - base over paired items, with a percentile bootstrap interval."""
    diffs = np.asarray(other, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, len(diffs), size=(BOOTSTRAP_SAMPLES, len(diffs)))].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = (float(v) for v in np.quantile(means, [tail, 1 - tail]))
    verdict = "better" if low > 0 else "worse" if high < 0 else "no detectable change"
    return Difference(float(diffs.mean()), low, high, verdict)


# ---------------------------------------------------------------- base vs adapters


@dataclass(frozen=True)
class TaskResult:
    task: Task
    scores: dict[str, Scores]  # model name ("base", then each adapter's file stem) -> its pass
    differences: dict[str, Difference]  # adapter name -> adapter - base

    def to_json(self) -> dict:
        return {
            "kind": self.task.kind, "items": len(self.task.items),
            "metrics": {name: s.metrics for name, s in self.scores.items()},
            "differences": {name: vars(d) for name, d in self.differences.items()},
            "per_item": [{"source": item.source} | {name: s.detail[i] for name, s in self.scores.items()}
                         for i, item in enumerate(self.task.items)],
        }


def loader(base: Path, *, weights: str, device) -> Callable:
    """`load(adapter_path | None)` -> (the base model with that adapter attached, device)."""
    from retrograd.evaluation.bench import attach_adapter_file
    from retrograd.gguf.adapter import read_adapter
    from retrograd.model.base import load_model
    from retrograd.recipes.common import compute_dtype

    def load(path: Path | None):
        model = load_model(base, weights=weights, compute_dtype=compute_dtype("auto", device), device=device)
        if path is not None:
            attach_adapter_file(model, read_adapter(path), path)
        return model, device

    return load


def evaluate(load: Callable, adapters: dict[str, Path], tasks: tuple[Task, ...], micro_batch: int,
             progress: Callable[[int], None], answerer: Answerer | None = None) -> list[TaskResult]:
    """Each model in turn (`load(adapter_path | None)` -> (BaseModel, device), the base first)
    over every task (generation tasks by `answerer`), then each adapter's paired differences
    against the base."""
    scores: dict[str, list[Scores]] = {}
    scored_by_torch = any(task.kind != "generation" for task in tasks)
    for name, path in ({"base": None} | adapters).items():
        model, device = load(path) if scored_by_torch else (None, None)
        scores[name] = [answerer.score(path, task, progress) if task.kind == "generation"
                        else score_task(model, task, micro_batch, device, progress) for task in tasks]
        del model
    results = []
    for k, task in enumerate(tasks):
        mine = {name: per_task[k] for name, per_task in scores.items()}
        results.append(TaskResult(task, mine, {name: paired_difference(mine["base"].items, mine[name].items)
                                               for name in adapters}))
    return results

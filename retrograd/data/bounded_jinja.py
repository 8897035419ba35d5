"""A Jinja sandbox with a budget, for the chat templates that come inside downloaded GGUF files.

Jinja's sandbox keeps a template away from Python's internals, not from the machine:
`'a' * 10**10`, nested `range` loops or a macro that calls itself twice would render for
hours or take all the memory. Every render here has a budget, and past any of its limits
it stops with BudgetExceeded, whose message names the limit:

- steps: loop iterations, calls (macros, methods, globals), filters and the operators
  `+ * ** %` and `~`, all counted; macro calls nest at most MAX_CALL_DEPTH deep;
- size: no value and no output is longer than MAX_TEXT characters (items, for a list).
  Operations that multiply a size (`*`, `**`, `%`, padding, `replace`, `join`, `indent`,
  `wordwrap`, `format`, `batch`, `slice`, `sum`, `tojson`, and every conversion of a value
  to text) are checked before they run, from their arguments;
- made: the characters made along the way, output and the literal text of every loop
  iteration and macro call included, at most MAX_MADE;
- a wall clock, MAX_SECONDS, as a backstop for work between two counted steps.

Constant folding is off (it would run filters at compile time, outside any budget), and
`lipsum` and `pprint` are gone (no chat template uses them, and their output is not
bounded by their input). Everything else renders exactly as in Jinja's immutable sandbox.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import ItemsView, KeysView, Mapping, ValuesView
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.runtime import Macro, Namespace, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_context
from jinja2.visitor import NodeTransformer

MAX_SOURCE = 1_000_000  # characters of template source
MAX_TEXT = 4_000_000  # characters of the output and of any one value
MAX_MADE = 16 * MAX_TEXT  # characters made by one render, output included
MAX_STEPS = 200_000  # counted steps of one render
MAX_SECONDS = 5.0  # wall time of one render
MAX_RANGE = 100_000  # items of one range()
MAX_INT_BITS = 4096  # size of an integer an operator makes
MAX_CALL_DEPTH = 100  # macro calls inside macro calls
MAX_INDENT = 64  # tojson's indent


class BudgetExceeded(Exception):
    """A template went past one of the limits above; the message names it."""


@dataclass
class _Budget:
    deadline: float
    steps: int = 0
    made: int = 0
    depth: int = 0
    sizes: dict[int, tuple[Any, int]] = field(default_factory=dict)  # id -> (container, text size), once per render


_BUDGET: ContextVar[_Budget | None] = ContextVar("retrograd_template_budget", default=None)


def render(template: jinja2.Template, context: Mapping[str, Any]) -> str:
    """template.render(context) within a fresh budget."""
    token = _BUDGET.set(_Budget(deadline=time.monotonic() + MAX_SECONDS))
    try:
        pieces, size = [], 0
        for piece in template.generate(context):
            size += len(piece)
            if size > MAX_TEXT:
                raise BudgetExceeded(f"output longer than {MAX_TEXT} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, metered: compile templates with compile_template() and
    render them with render()."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options):
        super().__init__(optimized=False, finalize=_finalize, **options)
        self.globals["range"] = _range
        del self.globals["lipsum"]
        del self.filters["pprint"]
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}
        self.filters |= {_CHARGE: _charge, _CONCAT: _concat}

    def compile_template(self, source: str) -> jinja2.Template:
        if len(source) > MAX_SOURCE:
            raise BudgetExceeded(f"the template is longer than {MAX_SOURCE} characters")
        tree = _Metered().visit(self.parse(source))
        tree.set_environment(self)
        return self.from_string(tree)

    def call(self, context, obj, /, *args, **kwargs):
        budget = _step()
        for key, arg in (*enumerate(args), *kwargs.items()):
            if key not in _JINJA_KEYWORDS:
                _check_size(_text_size(arg))
        method = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped by the sandbox
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str) and name in _STR_METHOD_SIZES:
            if name == "join":
                args = (list(args[0]), *args[1:]) if args else args
            _check_size(_STR_METHOD_SIZES[name](owner, *args, **kwargs))
        nested = budget is not None and isinstance(obj, Macro)
        if nested:
            budget.depth += 1
            if budget.depth > MAX_CALL_DEPTH:
                raise BudgetExceeded(f"macro calls nested deeper than {MAX_CALL_DEPTH}")
        try:
            return _made(super().call(context, obj, *args, **kwargs))
        finally:
            if nested:
                budget.depth -= 1

    def call_binop(self, context, operator, left, right):
        _step()
        _check_size(_binop_size(operator, left, right))
        if _int_bits(operator, left, right) > MAX_INT_BITS:
            raise BudgetExceeded(f"a number of more than {MAX_INT_BITS} bits")
        return _made(super().call_binop(context, operator, left, right))

    def getitem(self, obj, argument):
        value = super().getitem(obj, argument)
        return _made(value) if isinstance(argument, slice) else value


class _Metered(NodeTransformer):
    """Makes every loop iteration, macro call and call block pay a step and the literal text
    of its body (so an empty loop still counts, and text a loop repeats is text made), and
    `a ~ b` a counted step. Both go through filters, which Jinja calls directly."""

    def visit_For(self, node):
        self.generic_visit(node)
        cost = sum(_literal_chars(child) for child in node.body)
        node.body.insert(0, nodes.ExprStmt(_charge_node(cost)).set_lineno(node.lineno))
        if getattr(node, "test", None) is not None:  # `for x in xs if test`: items the test drops count too
            node.test = nodes.And(_charge_node(1), node.test).set_lineno(node.lineno)
        return node

    visit_Macro = visit_CallBlock = visit_For

    def visit_Concat(self, node):
        self.generic_visit(node)
        parts = nodes.Tuple(node.nodes, "load")
        return nodes.Filter(parts, _CONCAT, [], [], None, None).set_lineno(node.lineno)


def _charge_node(literal_chars: int) -> nodes.Expr:
    return nodes.Filter(nodes.Const(literal_chars), _CHARGE, [], [], None, None)


def _literal_chars(node: nodes.Node) -> int:
    total = 0
    for item in (node, *node.find_all(nodes.Node)):
        text = item.data if isinstance(item, nodes.TemplateData) else getattr(item, "value", None)
        total += 1 + (len(text) if isinstance(text, str) else 0)
    return total


# --- the budget -------------------------------------------------------------------------------

def _step() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is None:  # compiling: nothing runs but the parser
        return None
    budget.steps += 1
    if budget.steps > MAX_STEPS:
        raise BudgetExceeded(f"more than {MAX_STEPS} steps (loop iterations, calls, filters and operators)")
    if time.monotonic() > budget.deadline:
        raise BudgetExceeded(f"more than {MAX_SECONDS:g} s")
    return budget


_CHARGE, _CONCAT = "retrograd_charge", "retrograd_concat"  # the filters _Metered calls
_JINJA_KEYWORDS = ("_loop_vars", "_block_vars")  # Jinja's own bookkeeping, passed along with a call's arguments


def _charge(literal_chars: int) -> bool:
    _step()
    _add_made(literal_chars)
    return True


def _concat(parts: tuple) -> str:
    _step()
    for part in parts:
        _check_size(_text_size(part))
    return _made(str_join(parts))


def _add_made(chars: int) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.made += chars
        if budget.made > MAX_MADE:
            raise BudgetExceeded(f"more than {MAX_MADE} characters of text made")


def _check_size(size: int) -> None:
    if size > MAX_TEXT:
        raise BudgetExceeded(f"a value longer than {MAX_TEXT} characters")


def _made(value):
    size = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0
    _check_size(size)
    _add_made(size)
    return value


@pass_context
def _finalize(context, value):
    """Every {{ expression }} is text made. (Taking the context keeps Jinja from running
    this at compile time.)"""
    size = _text_size(value)
    _check_size(size)
    _add_made(size)
    return value


def _range(*args) -> range:
    items = range(*args)
    try:
        n = len(items)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise BudgetExceeded(f"range() of more than {MAX_RANGE} items")
    return items


# --- sizes ------------------------------------------------------------------------------------

def _text_size(value: Any) -> int:
    """About len(str(value)) (escapes, which at most multiply it by 10, aside), cheaply: each
    container is measured once per render, and a list holding one string a thousand times
    counts it a thousand times, as str() would print it."""
    if isinstance(value, str):
        return len(value)
    budget = _BUDGET.get()
    return _nested_size(value, budget.sizes if budget is not None else {})


def _nested_size(value: Any, memo: dict[int, tuple[Any, int]]) -> int:
    if isinstance(value, str):
        return 2 + len(value)
    if isinstance(value, int):
        return 2 + value.bit_length() // 3
    if value is None or isinstance(value, float):
        return 32
    if id(value) in memo:
        return memo[id(value)][1]
    items = _items(value)
    if items is None:
        return 64  # a macro, a loop, a range, a generator...: a short repr
    size = 2
    for item in items:
        size += 2 + _nested_size(item, memo)
        if size > MAX_TEXT:
            break
    if not isinstance(value, Namespace):  # the one container a template can change
        memo[id(value)] = (value, size)
    return size


def _items(value: Any):
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)):
        return value
    if isinstance(value, Namespace):
        return _items(object.__getattribute__(value, "_Namespace__attrs"))
    return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """Characters (or items) of the result, for the operators that can outgrow their operands."""
    sized = (str, list, tuple)
    if operator == "%" and isinstance(left, str):
        return _format_size(left, _PRINTF_FIELD, right)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "*":
        for sequence, times in ((left, right), (right, left)):
            if isinstance(sequence, sized) and isinstance(times, int):
                return len(sequence) * _int(times)
    return 0


def _int_bits(operator: str, left: Any, right: Any) -> int:
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if operator == "*":
        return left.bit_length() + right.bit_length()
    if operator == "**":
        return abs(left).bit_length() * _int(right) if abs(left) > 1 else 0
    return max(left.bit_length(), right.bit_length()) + 1


_PRINTF_FIELD = re.compile(r"%[^a-zA-Z%]*[a-zA-Z]?")  # a % conversion and its type letter
_FORMAT_FIELD = re.compile(r"\{[^{}]*")  # a {} field up to its end or a field nested in its spec
_WIDTH = re.compile(r"\d{1,8}")  # a width or precision; a longer run reads as several, each past MAX_TEXT


def _format_size(template: str, fields: re.Pattern, values: Any, from_values: bool = False) -> int:
    """An upper bound for formatting `values` into `template`: each field may print all the
    values (repr() escapes them: up to 10 characters each), padded to the widest width the
    template writes or (`*`, nested fields) the values pass."""
    found = fields.findall(template)
    flat = values.values() if isinstance(values, Mapping) else values if isinstance(values, tuple) else (values,)
    widest = max((int(width) for text in found for width in _WIDTH.findall(text)), default=0)
    if from_values or any("*" in text for text in found):
        widest += sum(_int(value) for value in flat)
    quoted = any(text.endswith(("r", "a")) or "!r" in text or "!a" in text for text in found)
    return len(template) + len(found) * (sum(map(_text_size, flat)) * (10 if quoted else 1) + widest)


def _str_format_size(template: str, *args, **kwargs) -> int:
    nested = re.search(r"\{[^{}]*\{", template) is not None
    return _format_size(template, _FORMAT_FIELD, (*args, *kwargs.values()), from_values=nested)


def _replace_size(text: Any, old: Any, new: Any, *_) -> int:
    if not all(isinstance(part, str) for part in (text, old, new)):
        return _text_size(text) * (1 + _text_size(new))
    places = text.count(old) if old else len(text) + 1
    return len(text) + places * max(len(new) - len(old), 0)


def _lines(text: Any) -> int:
    return text.count("\n") + 1 if isinstance(text, str) else _text_size(text) + 1


def _sum_size(iterable: list, attribute=None, start=0) -> int:
    """Adding lists or tuples copies the running total at every item."""
    return 0 if isinstance(start, (int, float)) else len(iterable) * _text_size(iterable)


_STR_METHOD_SIZES = {
    "ljust": lambda text, width, *_: max(len(text), _int(width)),
    "rjust": lambda text, width, *_: max(len(text), _int(width)),
    "center": lambda text, width, *_: max(len(text), _int(width)),
    "zfill": lambda text, width: max(len(text), _int(width)),
    "expandtabs": lambda text, tabsize=8: len(text) + text.count("\t") * _int(tabsize),
    "replace": lambda text, old, new, *_: _replace_size(text, old, new),
    "join": lambda separator, items: sum(map(_text_size, items)) + len(items) * len(separator),
    "format": _str_format_size,
    "format_map": lambda template, mapping: _str_format_size(template, **mapping),
    "translate": lambda text, table: len(text) * (1 + _text_size(table)),
}

# Jinja's filters whose output can outgrow their input, with their signatures (after the
# context/environment some of them are passed): the size of what each would make.
_FILTER_SIZES = {
    "center": lambda value, width=80: max(_text_size(value), _int(width)),
    "indent": lambda text, width=4, first=False, blank=False: (
        _text_size(text) + _lines(text) * (len(width) if isinstance(width, str) else _int(width))),
    "wordwrap": lambda text, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: (
        (_text_size(text) + 1) * (1 + _text_size(wrapstring or "\n"))),
    "replace": lambda text, old, new, count=None: _replace_size(text, old, new),
    "format": lambda template, *args, **kwargs: _format_size(str(template), _PRINTF_FIELD, kwargs or args),
    "join": lambda items, separator="", attribute=None: (
        sum(map(_text_size, items)) + len(items) * _text_size(separator)),
    "batch": lambda value, linecount, fill_with=None: 0 if fill_with is None else _int(linecount),
    "slice": lambda value, slices, fill_with=None: _int(slices),
    "sum": _sum_size,
}
_MATERIALIZED = ("join", "sum")  # their estimate walks the items before the filter does


def _bounded_filter(name: str, function):
    estimate = _FILTER_SIZES.get(name)
    passed = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context, eval context or environment

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        _step()
        if name in _MATERIALIZED and len(args) > passed:
            args = (*args[:passed], list(args[passed]), *args[passed + 1:])
        for arg in (*args[passed:], *kwargs.values()):
            _check_size(_text_size(arg))
        if estimate is not None:
            _check_size(estimate(*args[passed:], **kwargs))
        return _made(function(*args, **kwargs))

    return bounded


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """Hugging Face's tojson: non-ASCII and <>& left as they are. Indented text (whose
    indentation grows with the depth) is made piece by piece, up to MAX_TEXT."""
    if indent is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    if (len(indent) if isinstance(indent, str) else indent) > MAX_INDENT:
        raise BudgetExceeded(f"a tojson indent wider than {MAX_INDENT}")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        _check_size(size)
        pieces.append(piece)
    return "".join(pieces)

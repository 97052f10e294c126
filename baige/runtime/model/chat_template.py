"""Chat templates: compiled and rendered only in jinja2's immutable sandbox, with bounded work.

A chat template comes with the checkpoint (``tokenizer_config.json``, ``chat_template.jinja``, a
GGUF's ``tokenizer.chat_template``) or ``--chat-template``: code from the internet. The environment is
HF transformers' (``apply_chat_template``: ``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``, ``{% generation %}``,
``loopcontrols``), and the sandbox keeps the template away from Python internals (no ``_`` attributes,
no mutation of the messages). On top of it every render has a budget:

- ``MAX_LOOP_ITERATIONS`` iterations of ``{% for %}`` loops in all (each loop's iterable is wrapped
  when the template compiles), so nested loops cannot run for hours;
- ``MAX_BUILT_CHARS`` characters built in all by ``{{ }}`` output (inside ``{% set %}`` blocks and
  macros too) and by ``~`` and ``+``, so quadratic string building is bounded as well;
- no single string or list past ``MAX_CHARS``, nor integer past ``MAX_INT_BITS``, built by ``*``,
  ``**``, ``%``, ``~``/``+`` or the widening string methods and filters (``center``, ``ljust``,
  ``indent``, ``replace``, ``join``, ``format``, ...): each is checked before it is built, or right
  after when its operands already bound it;
- ``range`` is the sandbox's (at most 100000 items), ``lipsum`` is removed, and recursion past
  Python's limit stops the render.

Any violation is a :class:`ChatTemplateError` (a ``BaigeError``), one line naming the template.
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from baige.errors import BaigeError

MAX_LOOP_ITERATIONS = 2**20
MAX_CHARS = 2**26  # the largest string or list one operation may build
MAX_BUILT_CHARS = 2**30  # characters output and concatenated per render, in all
MAX_INT_BITS = 2**16  # the largest integer ``*`` / ``**`` may build
MAX_JSON_INDENT = 64
_NUMBER = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


class ChatTemplateError(BaigeError):
    """A chat template that does not compile, breaks the sandbox or exceeds its budget."""


class ChatTemplateUnsafe(ChatTemplateError):
    """A template that breaks the sandbox, exceeds its budget or recurses too deep."""


class _Overflow(jinja2.exceptions.TemplateRuntimeError):
    """Raised inside a render when the budget is spent (caught and named by :func:`render`)."""


@dataclass
class _Budget:
    iterations: int = 0
    chars: int = 0


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _budget() -> _Budget:
    budget = _BUDGET.get(None)
    if budget is None:  # rendered outside render(): give it a budget of its own
        budget = _Budget()
        _BUDGET.set(budget)
    return budget


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise _Overflow(f"{what} would be {n} long, past the limit of {MAX_CHARS}")


def _check_format(fmt: str, args: Any = ()) -> None:
    """A %-style or str.format string whose widths or precisions stay within the size limit, also
    those taken from the arguments (``%*d``, ``{:{}}``)."""
    for number in _NUMBER.findall(fmt):
        if len(number) > 8 or int(number) > MAX_CHARS:
            raise _Overflow(f"a format width of {number[:12]} is past the limit of {MAX_CHARS}")
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        values = args.values() if isinstance(args, dict) else args if isinstance(args, (tuple, list)) else (args,)
        if any(isinstance(v, int) and abs(v) > MAX_CHARS for v in values):
            raise _Overflow(f"a format width from its arguments is past the limit of {MAX_CHARS}")


@jinja2.pass_context  # (a context filter is never run at compile time by constant folding)
def _bounded_iter(context: Any, iterable: Iterable) -> Iterator:
    """The ``{% for %}`` iterable, counting every iteration against the render's budget."""
    budget = _budget()
    for item in iterable:
        budget.iterations += 1
        if budget.iterations > MAX_LOOP_ITERATIONS:
            raise _Overflow(f"its loops ran past {MAX_LOOP_ITERATIONS} iterations")
        yield item


def _count_chars(n: int) -> None:
    budget = _budget()
    budget.chars += n
    _check_size(n, "a string")
    if budget.chars > MAX_BUILT_CHARS:
        raise _Overflow(f"it built more than {MAX_BUILT_CHARS} characters")


@jinja2.pass_context
def _counted_text(context: Any, value: Any) -> str:
    """One piece of ``{{ }}`` output (or of ``~``), counted against the render's character budget."""
    text = value if isinstance(value, str) else str(value)
    _count_chars(len(text))
    return text


def _joined_size(sep: str, items: Any) -> int:
    items = list(items) if not isinstance(items, (list, tuple)) else items
    return len(sep) * max(len(items) - 1, 0) + sum(len(x) if isinstance(x, str) else 32 for x in items)


def _replaced_size(s: str, old: str, new: str, count: int = -1) -> int:
    hits = (s.count(old) if old else len(s) + 1) if count < 0 else count
    return len(s) + hits * max(len(new) - len(old), 0)


def _check_str_call(s: str, name: str, args: tuple, kwargs: dict) -> None:
    """Before a string method that can widen its string runs: the result's size within the limit."""
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        _check_size(args[0], f"str.{name}'s result")
    elif name == "expandtabs":
        _check_size(len(s) * (args[0] if args and isinstance(args[0], int) else 8), "str.expandtabs's result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(_replaced_size(s, args[0], args[1], *args[2:3]), "str.replace's result")
    elif name == "join" and args and isinstance(args[0], (list, tuple, str)):
        _check_size(_joined_size(s, args[0]), "str.join's result")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the budget of the module docstring."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_size(len(seq) * n, "a repeated string or list")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _Overflow(f"an integer product past {MAX_INT_BITS} bits")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right > 0 and left.bit_length() * right > MAX_INT_BITS:
                raise _Overflow(f"an integer power past {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        result = super().call_binop(context, operator, left, right)
        if operator == "+" and isinstance(result, str):
            _count_chars(len(result))
        elif operator == "+" and isinstance(result, (list, tuple)):
            _check_size(len(result), "a concatenated list")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` / ``format_map`` as the sandbox wraps them, their widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(fmt, args[0] if is_map and args else (*args, *kwargs.values()))
            return wrapped(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_call(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The template's syntax tree with every loop iterable, ``{{ }}`` output and ``~`` counted."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_baige_loop", [], [], None, None, lineno=loop.lineno)
        for output in tree.find_all(nodes.Output):
            output.nodes = [
                n if isinstance(n, nodes.TemplateData) else nodes.Filter(n, "_baige_text", [], [], None, None)
                for n in output.nodes
            ]
        for concat in list(tree.find_all(nodes.Concat)):
            concat.nodes = [nodes.Filter(n, "_baige_text", [], [], None, None) for n in concat.nodes]
        return tree


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as HF renders it).
    if isinstance(indent, int) and indent > MAX_JSON_INDENT or isinstance(indent, str) and len(indent) > 64:
        raise _Overflow(f"tojson indent past {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _widening_filters(env: jinja2.Environment) -> None:
    """Wrap the built-in filters that can build a string far larger than their input."""
    f = dict(env.filters)

    def center(value: Any, width: int = 80) -> str:
        _check_size(width, "center's result")
        return f["center"](value, width)

    def indent(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> str:
        pad = width if isinstance(width, int) else len(str(width))
        _check_size(len(str(value)) + pad * (str(value).count("\n") + 1), "indent's result")
        return f["indent"](value, width, *args, **kwargs)

    @jinja2.pass_eval_context
    def replace(eval_ctx: Any, s: Any, old: str, new: str, count: int | None = None) -> str:
        _check_size(_replaced_size(str(s), str(old), str(new), -1 if count is None else count), "replace's result")
        return f["replace"](eval_ctx, s, old, new, count)

    @jinja2.pass_eval_context
    def join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        _check_size(_joined_size(str(d), list(value) if not isinstance(value, (list, tuple)) else value), "join")
        return f["join"](eval_ctx, value, d, attribute)

    def format_(value: str, *args: Any, **kwargs: Any) -> str:
        _check_format(str(value), kwargs or (args[0] if len(args) == 1 and isinstance(args[0], dict) else args))
        return f["format"](value, *args, **kwargs)

    @jinja2.pass_environment
    def wordwrap(environment: Any, s: str, width: int = 79, *args: Any, **kwargs: Any) -> str:
        wrap = kwargs.get("wrapstring") or (args[1] if len(args) > 1 else None) or "\n"
        _check_size(len(str(s)) * (1 + len(str(wrap))), "wordwrap's result")
        return f["wordwrap"](environment, s, width, *args, **kwargs)

    def slice_(value: Any, slices: int, fill_with: Any = None) -> Any:
        _check_size(slices, "slice's count")
        return f["slice"](value, slices, fill_with)

    env.filters.update(
        center=center, indent=indent, replace=replace, join=join, format=format_, wordwrap=wordwrap, slice=slice_
    )


def compile_template(source: str, where: str) -> jinja2.Template:
    """Compile a chat template in the bounded sandbox, with HF's environment settings.

    Raises:
        ChatTemplateError: naming ``where``: not a string, or a syntax error.
    """
    if not isinstance(source, str):
        raise ChatTemplateError(f"chat template ({where}) is not a string but {type(source).__name__}")
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals.pop("lipsum", None)
    _widening_filters(env)
    env.filters.update(tojson=_tojson, _baige_loop=_bounded_iter, _baige_text=_counted_text)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template ({where}) does not compile: {e.message} (line {e.lineno})") from None
    except (RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template ({where}) does not compile: {type(e).__name__}") from None


def render(template: jinja2.Template, where: str, **variables: Any) -> str:
    """Render ``template`` with a fresh budget.

    Raises:
        ChatTemplateError: naming ``where``: a sandbox violation (``SecurityError``), the budget spent,
        recursion too deep, an arithmetic overflow, or any error the template raises
        (``raise_exception``, an undefined call, a type error in its expressions).
    """
    token = _BUDGET.set(_Budget())
    try:
        return template.render(**variables)
    except _Overflow as e:
        raise ChatTemplateUnsafe(f"chat template ({where}) exceeds its budget: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateUnsafe(f"chat template ({where}) violates the sandbox: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error ({where}): {e}") from None
    except RecursionError:
        raise ChatTemplateUnsafe(f"chat template ({where}) recurses too deep") from None
    except (OverflowError, MemoryError) as e:  # the sandbox's range past MAX_RANGE, float overflow
        raise ChatTemplateUnsafe(f"chat template ({where}) exceeds its budget: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
        raise ChatTemplateError(f"chat template error ({where}): {type(e).__name__}: {str(e)[:200]}") from None
    finally:
        _BUDGET.reset(token)


def probe_template(source: str, where: str, **variables: Any) -> jinja2.Template:
    """Compile ``source`` and render a one-message conversation, as a start-up check: a template that
    does not compile, breaks the sandbox or exceeds its budget even then fails now, not at the first
    request; one that merely rejects the sample conversation (``raise_exception``) passes.

    Raises:
        ChatTemplateError: naming ``where``.
    """
    template = compile_template(source, where)
    try:
        render(template, where, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True, **variables)
    except ChatTemplateUnsafe:
        raise
    except ChatTemplateError:
        pass  # the template's own verdict on the sample conversation
    return template

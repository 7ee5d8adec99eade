"""Chat templates from bundles, rendered in jinja2's immutable sandbox under hard limits.

A bundle's template is code written by whoever made the bundle. The sandbox stops attribute
escapes; the limits here stop the rest: a render gets `TemplateLimits.seconds` of wall time,
`max_output` characters of output and of any value it builds, `max_iterations` loop iterations
in all, ranges and size arguments of at most `max_range`, and `max_memory` bytes of growth of
the process's peak memory. The time limit does not rely on the template producing output: every
loop iteration, call, attribute or item access, arithmetic operator and filter checks the
deadline. Every failure, whatever the template raised, is one `ChatTemplateError` sentence.
"""

from __future__ import annotations

import re
import string
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "TemplateLimits"]


class ChatTemplateError(ValueError):
    """The template is invalid, refused the messages or went over a limit; one sentence."""


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 2.0
    max_output: int = 4_000_000  # characters, of the output and of any one value
    max_iterations: int = 2_000_000  # loop iterations, all loops of one render together
    max_range: int = 100_000  # range() lengths and integer size arguments (widths, counts)
    max_memory: int = 512 << 20  # growth of the process's peak resident memory, bytes


class _LimitExceeded(Exception):
    """Raised inside a render; turned into a ChatTemplateError by `ChatTemplate.render`."""


try:  # peak RSS: the backstop for blow-ups no pre-check foresees (Unix only)
    import resource

    def _peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
except ImportError:  # pragma: no cover - Windows

    def _peak_rss() -> int:
        return 0


class _Budget:
    """What one render may still spend."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.iterations = 0
        self.events = 0
        self.rss0 = _peak_rss()

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"it ran longer than {self.limits.seconds:g} s")
        self.events += 1
        if self.events % 256 == 0 and self.rss0 and _peak_rss() - self.rss0 > self.limits.max_memory:
            raise _LimitExceeded(f"it used more than {self.limits.max_memory >> 20} MiB of memory")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


# Filters whose integer arguments are sizes (a width, a count of pieces), not data.
_SIZED_FILTERS = frozenset(["center", "indent", "truncate", "wordwrap", "batch", "slice"])


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every hook a template cannot avoid charging the render's budget."""

    intercepted_binops = frozenset(["+", "*", "**", "%", "//", "/", "-"])

    def __init__(self, limits: TemplateLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.limits = limits
        self._local = threading.local()  # one environment, renders on several threads
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self._sized_globals = (self.globals["range"], self.globals["lipsum"])

    # -- budget -------------------------------------------------------------------------------

    @property
    def budget(self) -> _Budget:
        b = getattr(self._local, "budget", None)
        if b is None:  # compile-time constant folding runs outside a render
            b = self._local.budget = _Budget(self.limits)
        return b

    def _checked(self, value):
        if _size(value) > self.limits.max_output:
            raise _LimitExceeded(f"it built a value larger than {self.limits.max_output:,} items")
        return value

    def _check_ints(self, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.max_range:
                raise _LimitExceeded(f"it passed the number {a} where at most {self.limits.max_range:,} is allowed")

    def _check_format(self, fmt: str, args=()) -> None:
        cap = self.limits.max_range
        for m in _PERCENT_SPEC.finditer(fmt):
            for g in m.groups():
                if g and g != "*" and int(g) > cap:
                    raise _LimitExceeded(f"it asked for a field width of {g} characters")
        try:
            specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
        except ValueError:
            specs = []  # malformed: str.format itself refuses it
        for spec in specs:
            for digits in _DIGITS.findall(spec):
                if int(digits) > cap:
                    raise _LimitExceeded(f"it asked for a field width of {digits} characters")
        if "*" in fmt:  # '%*d': the width comes from the arguments
            self._check_ints(args if isinstance(args, tuple) else (args,), {})

    def _check_join(self, sep, items) -> None:
        if isinstance(items, (list, tuple)) and isinstance(sep, str):
            total = len(sep) * len(items) + sum(_size(x) for x in items)
            if total > self.limits.max_output:
                raise _LimitExceeded(f"it built a value larger than {self.limits.max_output:,} items")

    def _check_replace(self, s, old, new) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            bound = len(s) + (len(s) // max(len(old), 1) + 1) * len(new)
            if bound > self.limits.max_output:
                raise _LimitExceeded(f"it built a value larger than {self.limits.max_output:,} items")

    # -- sandbox hooks ------------------------------------------------------------------------

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        __self.budget.tick()
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # str.format comes wrapped
        name = getattr(__obj, "__name__", "")
        # integers are sizes for range/lipsum and the methods of strings and lists (ljust, zfill,
        # expandtabs, ...); for other calls (namespace(total=10**6), str.format's values) they are data
        if any(__obj is g for g in __self._sized_globals) or (
            isinstance(owner, (str, list)) and name not in ("format", "format_map")
        ):
            __self._check_ints(args, kwargs)
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                __self._check_format(owner)
            elif name == "join" and args:
                __self._check_join(owner, args[0])
            elif name == "replace" and len(args) >= 2:
                __self._check_replace(owner, args[0], args[1])
        return __self._checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        self.budget.tick()
        return self._checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        self.budget.tick()
        return self._checked(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        self.budget.tick()
        cap = self.limits.max_output
        if operator == "*":
            n, seq = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(n, int) and _size(seq) * max(n, 0) > cap:
                raise _LimitExceeded(f"it built a value larger than {cap:,} items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, (int, float)):
            if abs(left) > 1 and right > 64 and right * abs(left).bit_length() > 4096:
                raise _LimitExceeded("it computed a number with more than 4096 bits")
        elif operator == "+" and _size(left) + _size(right) > cap:
            raise _LimitExceeded(f"it built a value larger than {cap:,} items")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right)
        return self._checked(super().call_binop(context, operator, left, right))

    def _guard_filter(self, name, f):
        env = self

        def guarded(*args, **kwargs):
            env.budget.tick()
            plain = [
                a
                for a in args
                if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment))
            ]
            if name in _SIZED_FILTERS:
                env._check_ints(plain[1:], kwargs)
            if name == "format" and plain and isinstance(plain[0], str):
                env._check_format(plain[0], tuple(plain[1:]))
            elif name == "join" and plain:
                items = plain[0] if isinstance(plain[0], (list, tuple)) else None
                if items is not None:
                    env._check_join(plain[1] if len(plain) > 1 else kwargs.get("d", ""), items)
            elif name == "replace" and len(plain) >= 3:
                env._check_replace(str(plain[0]), plain[1], plain[2])
            return env._checked(f(*args, **kwargs))

        for attr in ("jinja_pass_arg", "__name__", "__doc__"):  # keep pass_context & co.
            if hasattr(f, attr):
                try:
                    setattr(guarded, attr, getattr(f, attr))
                except (AttributeError, TypeError):  # pragma: no cover
                    pass
        return guarded

    def guard_loop(self, iterable):
        """Every `for` loop of a template iterates through this (see `compile`)."""
        budget = self.budget
        for item in iterable:
            budget.iterations += 1
            if budget.iterations > self.limits.max_iterations:
                raise _LimitExceeded(f"it ran more than {self.limits.max_iterations:,} loop iterations")
            budget.tick()
            yield item

    def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
        # Route each loop's iterable through guard_loop: a loop with no call, no attribute access
        # and no output (`{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}`) meets no other
        # hook. An environment attribute, so no template name can shadow it.
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Call(
                nodes.EnvironmentAttribute("guard_loop"), [loop.iter], [], None, None, lineno=loop.lineno
            )
        return super().compile(source, name, filename, raw, defer_init)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else type(e).__name__
    return msg if len(msg) <= 200 else msg[:197] + "..."


class ChatTemplate:
    """A compiled chat template. `render` is safe to call from several threads at once."""

    def __init__(self, source: str, limits: TemplateLimits | None = None):
        self.limits = limits or TemplateLimits()
        self.env = _LimitedSandbox(self.limits)
        self.env.globals["raise_exception"] = _raise_exception
        self.env.globals["strftime_now"] = _strftime_now
        self.env._local.budget = _Budget(self.limits)
        try:
            self.template = self.env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the bundle's chat template is invalid: {_first_line(e)}") from None
        except _LimitExceeded as e:  # constant folding at compile time
            raise ChatTemplateError(f"the bundle's chat template is invalid: {e}") from None
        except (Exception, RecursionError) as e:  # noqa: BLE001 - any parse failure of untrusted text
            raise ChatTemplateError(
                f"the bundle's chat template is invalid: {type(e).__name__}: {_first_line(e)}"
            ) from None
        finally:
            self.env._local.budget = None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True, **variables) -> str:
        local = self.env._local
        local.budget = _Budget(self.limits)
        pieces: list[str] = []
        size = 0
        try:
            for piece in self.template.generate(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            ):
                size += len(piece)
                if size > self.limits.max_output:
                    raise _LimitExceeded(f"its output passed {self.limits.max_output:,} characters")
                local.budget.tick()
                pieces.append(piece)
        except _LimitExceeded as e:
            raise ChatTemplateError(f"the chat template was stopped: {e}") from None
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except jinja2.TemplateError as e:  # SecurityError, UndefinedError, include/import without a loader
            raise ChatTemplateError(f"the chat template refused the messages: {_first_line(e)}") from None
        except MemoryError:
            raise ChatTemplateError("the chat template was stopped: it ran out of memory") from None
        except RecursionError:
            raise ChatTemplateError("the chat template was stopped: it recursed too deeply") from None
        except Exception as e:  # noqa: BLE001 - untrusted code: TypeError, OverflowError, ZeroDivisionError, ...
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {_first_line(e)}") from None
        finally:
            local.budget = None
        return "".join(pieces)


class _TemplateRaised(Exception):
    """raise_exception(...) in a template: its message is for the user."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt):
    import datetime

    return datetime.datetime.now().strftime(str(fmt))

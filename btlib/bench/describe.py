"""The experiment in view: what a benchmark runs, where, and how it is checked and timed, printed from the declaration.

    print(describe("attention_dense"))      # in a notebook: display(describe(...)), one line, the rest folded

A benchmark cell that calls ``bench.run(bench.load_all()[name])`` hides the code inside the timed loop one or two
files away. :func:`describe` prints it from the objects that will run: the sizes, the check every provider passes
before it is timed, the protocol in force, and per provider the source of the call that is timed (file:line) with
the registered kernel it reaches and where that kernel's Python op is defined (from there a notebook shows the C++
source by file and function: btlib.kernels.cpu.source.show).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from ..kernels import get, kernels
from ..kernels.cpu.source import binding
from ..kernels.registry import Kernel
from .core import Benchmark, Provider, load_all, quick_mode
from ..fold import Folded
from .timing import protocol

__all__ = ["describe"]

_ROOT = Path(__file__).resolve().parents[2]  # the checkout: paths print relative to it
_QUOTES = ('"' * 3, "'" * 3)


def _where(obj, body: int = 3) -> tuple[str, int, list[str]]:
    """(file relative to the checkout, first line, code) of a function, or ("?", 0, []) where its source is unknown.

    code: a lambda's expression, or a named function's first ``body`` lines of code after its signature (its
    docstring and comments left out)."""
    try:
        lines, start = inspect.getsourcelines(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
    except (OSError, TypeError):
        return "?", 0, []
    try:
        shown = path.relative_to(_ROOT).as_posix()
    except ValueError:
        shown = path.name
    code = [line.strip() for line in lines if line.strip() and not line.strip().startswith(("@", "#"))]
    if getattr(obj, "__name__", "") == "<lambda>":
        first = code[0] if code else ""
        return shown, start, [_lambda_only(first[_lambda_start(obj, lines[0], first):])] if "lambda" in first else []
    in_doc, kept = False, []
    for text in code[1:]:  # after the def line
        if not in_doc and text.startswith(_QUOTES):
            in_doc = not (len(text) > 3 and text.endswith(_QUOTES))
            continue
        if in_doc:
            in_doc = not text.endswith(_QUOTES)
            continue
        kept.append(text)
        if len(kept) == body:
            break
    return shown, start, kept


def _lambda_start(fn, line: str, stripped: str) -> int:
    """Where in ``stripped`` (``line`` without its indentation) the lambda ``fn`` starts: the last "lambda" before the
    column its body's code begins at (a line may hold an outer lambda too: ``lambda: [Provider("a", lambda x: f(x))]``)."""
    cols = [c for ln, _, c, _ in fn.__code__.co_positions() if ln == fn.__code__.co_firstlineno and c is not None and c > 0]
    body = min(cols, default=len(line)) - (len(line) - len(line.lstrip()))
    at = stripped.rfind("lambda", 0, max(body, 0))
    return at if at >= 0 else stripped.index("lambda")


def _lambda_only(text: str) -> str:
    """The longest prefix of ``text`` that parses as one lambda expression (a source line holds what follows it too)."""
    for end in range(len(text), 0, -1):
        try:
            if isinstance(ast.parse(text[:end], mode="eval").body, ast.Lambda):
                return text[:end]
        except SyntaxError:
            continue
    return text


def _kernels_reached(provider: Provider) -> list[str]:
    """The registered kernels a provider's callable names: strings in its code's constants, and names or Kernel
    objects in its default arguments and closure cells (``lambda x, k=k: k.fn(...)``, ``get("cpu_flash_v3").fn(...)``),
    and the constants of a module-level btlib function it calls (``lambda x: _btlib(x, ...)``, one level down)."""
    fn, names = provider.fn, {k.name for k in kernels()}
    code = getattr(fn, "__code__", None)
    values = list(getattr(code, "co_consts", ()) or ()) + list(getattr(fn, "__defaults__", None) or ())
    for name in getattr(code, "co_names", ()):
        called = getattr(fn, "__globals__", {}).get(name)
        if inspect.isfunction(called) and called.__module__.startswith("btlib."):
            values += list(called.__code__.co_consts)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    found = {v for v in values if isinstance(v, str) and v in names}
    found |= {v.name for v in values if isinstance(v, Kernel)}
    return sorted(found)


def _helpers(fn) -> list:
    """The benchmark module's own private functions a provider's call goes through (``lambda x: _mha_call(x, ...)``):
    what the timed call does is in their bodies, so describe prints them beside the call."""
    code = getattr(fn, "__code__", None)
    found = [getattr(fn, "__globals__", {}).get(name) for name in getattr(code, "co_names", ())]
    return [f for f in found if inspect.isfunction(f) and f.__name__.startswith("_")
            and f.__module__.startswith("btlib.bench.")]


def _body(fn, most: int = 10) -> list[str]:
    """A function's source without its docstring, indentation kept, at most ``most`` lines (then "...")."""
    lines = [line.rstrip() for line in inspect.getsourcelines(fn)[0]]
    tree = ast.parse(inspect.getsource(fn)).body[0]
    first = tree.body[0]
    if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and len(tree.body) > 1:
        lines = lines[: first.lineno - 1] + lines[first.end_lineno:]  # the docstring says what, the code is the how
    lines = [line for line in lines if line.strip()]
    return lines[:most] + (["    ..."] if len(lines) > most else [])


def _clip(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(bench: str | Benchmark, quick: bool | None = None, *, params: dict | None = None, x_vals=None,
             providers=None, rounds: int | None = None, **timing) -> Folded:
    """What ``btlib.bench.run(bench)`` would run, as lines of text (see the module's docstring); ``params``,
    ``x_vals``, ``providers``, ``rounds`` and the timing keywords (``warmup``, ``min_runs``, ``max_runs``,
    ``min_time_s``) as a cell passes them to ``run`` / ``run_rounds``. A :class:`btlib.fold.Folded`: printed,
    the whole text; displayed in a notebook, one line with the text folded under it."""
    b = load_all()[bench] if isinstance(bench, str) else bench
    quick = quick_mode() if quick is None else quick
    fields = {"rounds": rounds, "warmup": timing.get("warmup"), "min_calls": timing.get("min_runs"),
              "max_calls": timing.get("max_runs"), "min_trial_s": timing.get("min_time_s")}
    timed = dataclasses.replace(protocol(quick), **{k: v for k, v in fields.items() if v is not None})
    params = {**b.params, **({k: v for k, v in b.quick.items() if k != "x_vals"} if quick else {}), **(params or {})}
    x_vals = x_vals if x_vals is not None else b.quick.get("x_vals", b.x_vals) if quick else b.x_vals
    file, line, _ = _where(b.make_inputs)
    rfile, rline, rcode = _where(b.reference, body=1)
    name = getattr(b.reference, "__name__", "the reference")
    reference = (rcode[0] if name == "<lambda>" and rcode else name) + f" ({rfile}:{rline})"
    lines = [f"{b.name}: {b.description}",
             f"  sizes{' (quick mode)' if quick else ''}: {b.x_name} in {tuple(x_vals)}; "
             + ", ".join(f"{k} {v}" for k, v in params.items() if not isinstance(v, (list, tuple)) or len(v) < 9),
             f"  inputs: {getattr(b.make_inputs, '__name__', '?')} ({file}:{line})",
             f"  checked first, against {_clip(reference, 90)}: error <= {b.tol:g} (or the provider's own tolerance); "
             "a provider that fails is not timed",
             f"  timed: {timed}",
             "  providers, and the call each timed repetition makes:"]
    helpers: list = []
    for p in b.providers():
        if providers is not None and p.name not in providers:
            continue
        helpers += [f for f in _helpers(p.fn) if f not in helpers]
        file, line, code = _where(p.fn)
        lines.append(f"    {p.name:<20s} {file}:{line}")
        lines += [f"    {'':<20s}   {_clip(text)}" for text in code]
        for name in _kernels_reached(p):
            k = get(name)
            kfile, kline, _ = _where(k.fn)
            lines.append(f"    {'':<20s}   -> kernel {name}: {getattr(k.fn, '__name__', '?')} ({kfile}:{kline})")
            if getattr(k.fn, "op_name", None):  # a C++ op: the folder's binding, whose includes are the kernel's source
                bfile, bline = binding(k.fn.op_name)
                lines.append(f"    {'':<20s}      C++: btlib/kernels/cpu/{bfile}:{bline} binds it; its kernel is in that folder's headers")
    for f in helpers:
        hfile, hline, _ = _where(f)
        lines.append(f"  {f.__name__}, which the calls above go through ({hfile}:{hline}):")
        lines += [f"    {text}" for text in _body(f)]  # whole lines: a clipped call would hide its arguments
    return Folded(f"how {b.name} is run, checked and timed (providers, sizes, the protocol, the code each call runs)",
                  "\n".join(lines))

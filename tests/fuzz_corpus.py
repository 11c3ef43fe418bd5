"""Differential fuzzer of ``python -m btlib.embed``: random corpora against ``model.encode`` of rows parsed here.

Each case writes a seeded random corpus (text, JSON lines, or Parquet where pyarrow imports) full of what breaks
line readers: CRLF and lone "\\r", U+2028 / U+0085 / \\x0b / \\x0c, NUL, tabs, emoji, lines of thousands of
characters, blank lines, an empty file, no final newline, a BOM at the start, a trailing blank line, bytes
that are not UTF-8, JSON "\\ud800" escapes, a null or missing field. Its expected rows come from :func:`parse`,
written here from the rules alone (btlib.serve.corpus's docstring), not from btlib's reader:

    strip a BOM at the start; split at b"\\n" (a final b"\\n" ends the last row, it opens none); drop one b"\\r"
    at the end of each row; decode strict UTF-8; JSON lines: each row one object with a str field, no blank row,
    no lone surrogate.

Then a scenario runs :func:`btlib.embed.embed_file` (once; edited between two runs; killed by a KeyboardInterrupt
from on_shard, maybe edited, resumed; a shard damaged or meta.json edited (tests/corpus_damage.py: truncated,
flipped, swapped, moved shards; sums, hashes, rows, the shard list, a setting edited; meta.json cut short, not JSON,
deleted), read, run again; a second folder under another BTLIB_GEMM)
and checks either ``read_embeddings(out)`` equals ``model.encode(rows)`` to 1e-6 with meta.json's rows (and the
shards redone are exactly those whose rows changed; a fresh folder, the same bits), or the run fails with an error
naming the first bad line (``name line n``; Parquet ``row i``). Anything else is a finding.

The model is loaded once and handed to every run (btlib.pretrained.load_pretrained is patched while cases run),
and the job record (btlib.embed.jobs_file) is the work folder's. A long run:

    python tests/fuzz_corpus.py --cases 500 [--seed 0] [--case N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from corpus_damage import check, damage_shard, edit_meta

BOM = b"\xef\xbb\xbf"
PIECES = ["packed", "tokens", "cost", "only", "their", "length", "a", "the", "Zürich", "naïve", "東京", "😀", "👩‍💻",
          "\t", "\r", "\u2028", "\u0085", "\x0b", "\x0c", "\x00", "\ufeff", "  ", "e\u0301", '"', "\\", "{}", "\u00a0"]


def text(rng: random.Random) -> str:
    """One random row: empty, words and adversarial characters, or rarely a line of thousands of characters."""
    r = rng.random()
    if r < 0.1:
        return ""
    if r < 0.14:
        return " ".join(rng.choice(PIECES[:12]) for _ in range(rng.randint(400, 900)))
    return "".join(rng.choice(PIECES) + rng.choice(["", " "]) for _ in range(rng.randint(1, 12)))


def encode_file(rng: random.Random, fmt: str, rows: list[str], column: str, faults: bool) -> bytes:
    """A text or JSON lines file of ``rows`` with random line ends, BOM, final newline; ``faults``: maybe a bad line."""
    if fmt == "jsonl":
        lines = [json.dumps({"id": i, column: t}, ensure_ascii=rng.random() < 0.5).encode() for i, t in enumerate(rows)]
    else:
        lines = [t.encode() for t in rows]
    if faults and lines and rng.random() < 0.6:
        i = rng.randrange(len(lines))
        fault = rng.choice(["latin1", "blank", "json", "surrogate", "null", "missing", "list"] if fmt == "jsonl" else ["latin1"])
        lines[i] = {"latin1": lines[i][:3] + b"caf\xe9" + lines[i][3:], "blank": rng.choice([b"", b"  ", b"\t"]),
                    "json": b'{"%s": "unterminated' % column.encode(), "surrogate": b'{"%s": "x \\ud800 y"}' % column.encode(),
                    "null": b'{"%s": null}' % column.encode(), "missing": b'{"other": "no such field"}', "list": b"[1, 2]"}[fault]
    data = b"".join(line + rng.choice([b"\n", b"\n", b"\r\n"]) for line in lines)
    if data and rng.random() < 0.25:
        data = data.rstrip(b"\n").removesuffix(b"\r")  # no final newline
    if fmt == "text" and rng.random() < 0.1:
        data += b"\n"  # a trailing blank line: one more (empty) row
    return (BOM if rng.random() < 0.2 else b"") + data


def parse(fmt: str, data: bytes, column: str = "text") -> tuple[list[str] | None, int | None]:
    """(rows, None), or (None, the 1-based line of the first error), from the rules alone."""
    data = data.removeprefix(BOM)
    lines = data.split(b"\n") if data else []
    if data.endswith(b"\n"):
        lines.pop()
    rows = []
    for n, line in enumerate(lines, 1):
        line = line.removesuffix(b"\r")
        if fmt == "jsonl" and all(c in b" \t\r\x0b\x0c" for c in line):
            return None, n
        try:
            s = line.decode("utf-8")
            if fmt == "jsonl":
                s = json.loads(s)[column]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
            return None, n
        if not isinstance(s, str) or any(0xD800 <= ord(c) <= 0xDFFF for c in s):
            return None, n
        rows.append(s)
    return rows, None


class Case:
    """One corpus on disk and its expected rows (or the line that must be named)."""

    def __init__(self, rng: random.Random, folder: Path, fmt: str, faults: bool):
        self.rng, self.fmt, self.folder = rng, fmt, folder
        self.path = folder / {"text": "c.txt", "jsonl": "c.jsonl", "parquet": "c.parquet"}[fmt]
        self.column = "text" if fmt == "text" else rng.choice(["text", "body"])
        self.rows = [text(rng) for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 13]))]
        self.write(faults)

    def write(self, faults: bool) -> None:
        if self.fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            values = list(self.rows)
            if faults and values and self.rng.random() < 0.3:
                values[self.rng.randrange(len(values))] = None
            pq.write_table(pa.table({self.column: pa.array(values, pa.string())}), self.path)
            bad = next((i for i, v in enumerate(values) if v is None), None)
            self.expected, self.bad = (values, None) if bad is None else (None, bad)
            return
        data = encode_file(self.rng, self.fmt, self.rows, self.column, faults)
        self.path.write_bytes(data)
        self.expected, self.bad = parse(self.fmt, data, self.column)

    def edit(self) -> None:
        """Replace, insert or delete a few rows and write the file again (no faults: the edit must embed)."""
        for _ in range(self.rng.randint(1, 3)):
            op = self.rng.choice(["replace", "insert", "delete"] if self.rows else ["insert"])
            i = self.rng.randrange(len(self.rows) + (op == "insert"))
            if op == "replace":
                self.rows[i] = text(self.rng)
            elif op == "insert":
                self.rows.insert(i, text(self.rng))
            else:
                del self.rows[i]
        self.write(False)

    def where(self) -> str:
        return f"{self.path.name} row {self.bad} (0-based)" if self.fmt == "parquet" else f"{self.path.name} line {self.bad}"


def chunks(rows: list[str], size: int) -> list[list[str]]:
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def check_result(case: Case, out: Path, model, embed) -> str | None:
    """None if out reads back as model.encode(case.expected) with meta.json's rows, else what differs."""
    got = embed.read_embeddings(out)
    want = model.encode(case.expected).numpy()
    rows = json.loads((out / "meta.json").read_text())["rows"]
    if got.shape != want.shape or rows != len(case.expected):
        return f"read {got.shape}, meta rows {rows}, expected {want.shape}"
    err = float(np.abs(got - want).max()) if len(want) else 0.0
    return None if err <= 1e-6 else f"max |read - encode| = {err:.2e}"


def run_case(i: int, seed: int, work: Path, model, embed, seen: Counter) -> str | None:
    """One case (seeded by seed and i): None if it holds, else the finding. ``seen`` counts what the case exercised."""
    rng = random.Random(f"{seed}:{i}")
    folder = work / f"case{i}"
    folder.mkdir()
    fmts = ["text", "jsonl"] + (["parquet"] if _has_pyarrow() else [])
    scenario = rng.choice(["once", "once", "edit", "kill", "damage", "damage", "meta", "meta", "fresh"])
    case = Case(rng, folder, rng.choice(fmts), faults=scenario == "once")
    kw = dict(column=case.column, shard_size=rng.randint(1, 5), max_batch_tokens=rng.choice([16, 64, 256]), progress=False)
    out = folder / "out"
    seen[f"{case.fmt} {scenario}" + (" -> error" if case.expected is None else f", {len(case.expected)} rows")] += 1
    try:
        if case.expected is None:
            try:
                embed.embed_file(case.path, out, **kw)
            except (ValueError, TypeError) as e:  # "line 1" must not pass for "line 12"
                named = re.search(re.escape(case.where()) + r"(?!\d)", str(e))
                return None if named else f"error {e!r} does not name {case.where()}"
            return f"no error, expected one naming {case.where()}"
        stop = _stop_at(rng, len(case.expected), kw["shard_size"], scenario)
        first = embed.embed_file(case.path, out, **kw, on_shard=stop)
        if stop is not None:
            return f"the run was not stopped by on_shard: {first}"
    except KeyboardInterrupt:
        pass
    before = chunks(case.expected, kw["shard_size"])
    if scenario in ("edit", "kill") and rng.random() < (1.0 if scenario == "edit" else 0.5):
        case.edit()
    if scenario == "damage" and any(out.glob("shard-*.npy")) or scenario == "meta":
        good, runs = embed.read_embeddings(out), []
        if scenario == "meta":
            how, names = edit_meta(rng, out), ["meta.json", "shard-"]
        else:
            how, victim, names = damage_shard(rng, out)
        seen[f"~{scenario}: {how}"] += 1  # ~: what was done to the folder
        why = check(how, names, out, embed.read_embeddings, lambda: runs.append(embed.embed_file(case.path, out, **kw))
                    or runs[-1], good)
        if why is None and scenario == "damage" and how not in ("deleted", "moved", "swapped"):
            if not runs[0]["redone"].get(int(victim.name[6:11]), "").startswith("it was damaged"):
                why = f"a {how} shard was not redone as damaged: {runs[0]['redone']}"
        return why or (None if how.startswith("setting") else check_result(case, out, model, embed))
    if scenario in ("edit", "kill", "fresh"):
        r = embed.embed_file(case.path, out, **kw)
        after = chunks(case.expected, kw["shard_size"])
        changed = {k for k in range(min(len(before), len(after))) if before[k] != after[k]}
        redone = {k for k, why in r["redone"].items() if why == "its rows changed"}
        if scenario == "edit" and redone != changed:
            return f"redone {sorted(redone)} because their rows changed; changed: {sorted(changed)}"
        if scenario == "fresh":
            with _env("BTLIB_GEMM", rng.choice(["torch", "onednn"])):
                embed.embed_file(case.path, folder / "fresh", **kw)
            if not np.array_equal(embed.read_embeddings(out), embed.read_embeddings(folder / "fresh")):
                return "a second folder of the same job (another BTLIB_GEMM) holds other bits"
    return check_result(case, out, model, embed)


def _stop_at(rng: random.Random, rows: int, size: int, scenario: str):
    if scenario != "kill" or rows == 0:
        return None
    stop = rng.randrange(-(-rows // size))

    def hook(k: int) -> None:
        if k == stop:
            raise KeyboardInterrupt
    return hook


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def run(cases: int, seed: int = 0, only: int | None = None, model=None,
        seen: Counter | None = None) -> tuple[int, list[str]]:
    """(cases run, findings). The model is loaded once (or passed in) and every embed_file run takes it; ``seen``
    (if given) counts the cases by format, scenario and outcome."""
    import btlib.embed as embed
    import btlib.pretrained as pretrained

    model = model if model is not None else pretrained.load_pretrained()
    findings, seen = [], seen if seen is not None else Counter()
    ids = [only] if only is not None else range(cases)
    with tempfile.TemporaryDirectory(prefix="fuzz_corpus-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        patch = pytest_free_patch(stack)
        patch(pretrained, "load_pretrained", lambda folder=None: model)
        patch(embed, "jobs_file", lambda: work / "jobs.json")
        for i in ids:
            try:
                why = run_case(i, seed, work, model, embed, seen)
            except Exception as e:  # a crash is a finding too, with its case to rerun
                why = f"raised {type(e).__name__}: {e}"
            if why:
                findings.append(f"case {i} (--seed {seed} --case {i}): {why}")
    return len(ids), findings


def pytest_free_patch(stack: contextlib.ExitStack):
    """setattr(obj, name, value) undone when ``stack`` closes (so the fuzzer runs without pytest too)."""
    def patch(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        stack.callback(setattr, obj, name, old)
    return patch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=None, help="run only this case (as a finding names it)")
    args = p.parse_args()
    t0 = time.perf_counter()
    seen: Counter = Counter()
    n, findings = run(args.cases, args.seed, args.case, seen=seen)
    print(f"{n} cases (seed {args.seed}) in {time.perf_counter() - t0:.0f} s: {len(findings)} findings")
    done = {k[1:]: v for k, v in seen.items() if k.startswith("~")}
    seen = Counter({k: v for k, v in seen.items() if not k.startswith("~")})
    kinds = Counter(k.split(",")[0].replace(" -> error", "") for k in seen)
    print("  by format and scenario:", ", ".join(f"{k} {sum(v for s, v in seen.items() if s.startswith(k))}"
                                                   for k in sorted(kinds)))
    print("  by what was done to the folder:", ", ".join(f"{k} {v}" for k, v in sorted(done.items())))
    print(f"  expected errors (a bad line named): {sum(v for k, v in seen.items() if k.endswith('error'))}; "
          f"empty corpora: {sum(v for k, v in seen.items() if k.endswith(' 0 rows'))}")
    for f in findings:
        print(" ", f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

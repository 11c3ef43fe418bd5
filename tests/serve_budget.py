"""Memory and time as part of the server fuzzer's oracle (tests/fuzz_serve.py): what each answer may cost.

The servers run in the fuzzer's process, so memory is the process's own (/proc/self/status; the oracle's
sentence-transformers models included, loaded before the start is measured). Bounds, checked after every case:

    forward   every server's largest forward since it started (GET /metrics, btlib_serve_batch_tokens{quantile="1"})
              <= its max_batch_tokens: no request, chunked or not, makes a forward past the budget
    memory    the process's peak RSS while a case's requests are answered (VmHWM, reset once the oracle has drawn
              its expectations, read before it judges the answers) <= its RSS at the case's start + RSS_BOUND
              (400 MiB: one body at the payload limit costs ~300 MiB to tokenize, tokenizers' encoding holding ~150x
              its bytes; big bodies sent at once are tokenized one at a time); a chunked request costs its slices,
              not its size. And <= the RSS at the campaign's start + (servers + 1) x GROWTH_PER_THREAD (350 MiB): glibc
              keeps a thread's freed memory in its arena, and each server's tokenizing thread (and the oracle's) may
              keep one big body's
    leaks     at the end, each server answers the same valid request (a chunked one on the chunking server) n times
              (400 in a campaign, 60 in CI): the RSS after the last n - 50 <= after the first 50 + LEAK_BOUND (16 MiB)
              (the last half after the first, for n < 100)
    time      each answer within SLACK_S + FACTOR x the time expected from rates measured at the start, on this
              machine, before any case: ceil(tokens / max_batch_tokens) full forwards (tokens: what the oracle says
              the request runs, chunks included, and those of the requests sent with it in a burst) plus its body's
              bytes at the tokenizing rate; a refusal runs 0 tokens
    health    GET /health within HEALTH_S while a big request (a body past 64 KB, or more than 4 forwards) is in flight

    watch = Watch(client, targets)                      # measures the rates and the memory at the start
    bound = watch.bound_s(target, tokens, body_bytes)   # seconds an answer may take
    findings = watch.after([target])                    # the forward and memory bounds, now
    print(watch.summary())                              # the largest values seen, against their bounds
"""

from __future__ import annotations

import math
import re
import statistics
import time

MIB = 1 << 20
RSS_BOUND = 400 * MIB  # one case: one ~1.9 MB body's tokenizing (~300 MiB: tokenizers' encoding) and 100 MiB
GROWTH_PER_THREAD = 350 * MIB  # the whole campaign: each server's tokenizing thread and the oracle's may keep one big body's
LEAK_BOUND = 16 * MIB  # the same requests again and again: what 150 more of them may add
SLACK_S, FACTOR = 2.0, 20.0
HEALTH_S = 0.5
BIG_BYTES = 64 << 10


def memory() -> tuple[int, int]:
    """(RSS, peak RSS) of this process in bytes (Linux)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0; where refused the peak counts from the process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _full_request(t) -> tuple[str, dict]:
    """A request of max_inputs inputs at max_len tokens each, truncated: (path, body) on the target's own route."""
    text = " ".join(["w1"] * t.max_len)
    if t.kind == "reranker":
        return "/rerank", {"query": "w2", "texts": [text] * t.max_inputs, "truncate": True}
    return ("/embed_sparse" if t.kind == "sparse" else "/embed"), {"inputs": [text] * t.max_inputs, "truncate": True}


class Watch:
    def __init__(self, client, targets, runs: int = 5):
        self.client, self.targets = client, targets
        self.forward_s = {}  # target name -> seconds per full forward (median over runs)
        for t in targets:
            path, body = _full_request(t)
            tokens = t.max_inputs * t.max_len
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                client.post(t.url + path, json=body).raise_for_status()
                times.append(time.perf_counter() - t0)
            self.forward_s[t.name] = statistics.median(times) / math.ceil(tokens / t.budget)
        t = next(t for t in targets if t.kind == "embedding")
        big = " ".join(["w3"] * 60_000)  # 180 KB: tokenized whole (then cut), one forward
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            client.post(t.url + "/embed", json={"inputs": big, "truncate": True}).raise_for_status()
            times.append(time.perf_counter() - t0)
        self.bytes_per_s = len(big) / statistics.median(times)
        self.rss0, _ = memory()
        self.growth_bound = (len(targets) + 1) * GROWTH_PER_THREAD
        reset_peak()
        self.largest = {t.name: 0 for t in targets}  # largest forward seen, tokens
        self.peak, self.rss_case, self.growth, self.grown = self.rss0, self.rss0, 0, False  # growth: the most one case added to its start
        self.worst_time = (0.0, 0.0, "")  # (elapsed / bound, elapsed, what)
        self.worst_health, self.leaked = 0.0, 0

    def bound_s(self, t, tokens: int, body_bytes: int) -> float:
        expected = math.ceil(tokens / t.budget) * self.forward_s[t.name] + body_bytes / self.bytes_per_s
        return SLACK_S + FACTOR * expected

    def timed(self, t, tokens: int, body_bytes: int, elapsed: float, what: str) -> str | None:
        """A finding if an answer took longer than its bound."""
        bound = self.bound_s(t, tokens, body_bytes)
        if elapsed / bound > self.worst_time[0]:
            self.worst_time = (elapsed / bound, elapsed, f"{what}, {tokens} tokens, {body_bytes} bytes, bound {bound:.2f} s")
        if elapsed > bound:
            return f"answered in {elapsed:.2f} s, past its bound {bound:.2f} s ({tokens} tokens, {body_bytes} bytes)"
        return None

    def health(self, t) -> tuple[float, str | None]:
        """One GET /health: (seconds, a finding if it took past HEALTH_S or was not 200)."""
        t0 = time.perf_counter()
        try:
            r = self.client.get(t.url + "/health", timeout=10)
            status = r.status_code
        except Exception as e:  # httpx's errors: no answer is a finding too
            status = f"{type(e).__name__}"
        s = time.perf_counter() - t0
        self.worst_health = max(self.worst_health, s)
        if status != 200 or s > HEALTH_S:
            return s, f"GET /health during a big request: {status} in {s:.2f} s (bound {HEALTH_S} s)"
        return s, None

    def begin(self) -> None:
        """A case's requests are about to be sent (the oracle's own work for them done): the peak counts from here."""
        self.rss_case, _ = memory()
        reset_peak()

    def after(self, targets) -> list[str]:
        """The forward and memory bounds once a case's answers are in (before the oracle judges them): findings."""
        findings = []
        for t in {t.name: t for t in targets}.values():
            text = self.client.get(t.url + "/metrics").text
            m = re.search(r'^btlib_serve_batch_tokens\{quantile="1"\} (\S+)$', text, re.M)
            largest = float(m.group(1)) if m else 0.0
            self.largest[t.name] = max(self.largest[t.name], largest)
            if largest > t.budget:
                findings.append(f"[{t.name}] a forward of {largest:g} tokens, past max_batch_tokens {t.budget}")
        _, peak = memory()
        self.peak = max(self.peak, peak)
        self.growth = max(self.growth, peak - self.rss_case)
        if peak > self.rss_case + RSS_BOUND:
            findings.append(f"peak RSS {peak / MIB:.0f} MiB while answering, past {self.rss_case / MIB:.0f} MiB at the "
                            f"case's start + {RSS_BOUND / MIB:.0f} MiB")
        if peak > self.rss0 + self.growth_bound and not self.grown:
            self.grown = True  # said once: every case after it would say it again
            findings.append(f"peak RSS {peak / MIB:.0f} MiB while answering, past {self.rss0 / MIB:.0f} MiB at the "
                            f"campaign's start + {self.growth_bound / MIB:.0f} MiB: what answers leave behind accumulates")
        return findings

    def leaks(self, n: int) -> list[str]:
        """Each server answers one valid request ``n`` times (a chunked one on a chunking server): findings if the RSS
        grows by more than LEAK_BOUND over the last n - 50 (the last half, for n < 100)."""
        findings = []
        for t in self.targets:
            path, body = _full_request(t)
            if t.long_inputs == "chunk":
                body = {"inputs": [" ".join(["w4"] * 3 * t.max_len), "w5"]}  # 3 chunks and a short text: 2 forwards
            warm = min(50, n // 2)
            for k in range(n):
                if k == warm:
                    before, _ = memory()
                self.client.post(t.url + path, json=body).raise_for_status()
            after, _ = memory()
            self.leaked = max(self.leaked, after - before)
            if after - before > LEAK_BOUND:
                findings.append(f"[{t.name}] {n - warm} more of the same request grew the RSS by "
                                f"{(after - before) / MIB:.1f} MiB (bound {LEAK_BOUND / MIB:.0f})")
        return findings

    def summary(self) -> list[str]:
        rates = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.forward_s.items())
        largest = ", ".join(f"{t.name} {self.largest[t.name]:g}/{t.budget}" for t in self.targets)
        return [f"rates at the start: a full forward {rates}; tokenizing {self.bytes_per_s / 1e6:.2f} MB/s",
                f"largest forward, tokens / max_batch_tokens: {largest}",
                f"peak RSS {self.peak / MIB:.0f} MiB, {(self.peak - self.rss0) / MIB:+.0f} MiB over the start "
                f"(bound +{self.growth_bound / MIB:.0f}); the most one case added to the RSS at its start {self.growth / MIB:.0f} MiB "
                f"(bound {RSS_BOUND / MIB:.0f})",
                f"slowest answer against its bound: {self.worst_time[1]:.2f} s = {self.worst_time[0]:.2f} of the bound "
                f"({self.worst_time[2]}); slowest /health during a big request {self.worst_health * 1e3:.0f} ms "
                f"(bound {HEALTH_S * 1e3:.0f}); the same request again and again grew the RSS by at most "
                f"{self.leaked / MIB:.1f} MiB (bound {LEAK_BOUND / MIB:.0f})"]

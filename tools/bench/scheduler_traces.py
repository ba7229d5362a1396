"""Request traces for the scheduler benchmark (tools/bench/scheduler_bench.py).

A trace is a list of sessions; a session starts at `start_s` and sends its
turns one after another: turn k's prompt is the session's whole context so
far (the previous prompt plus the output the engine produced for it) plus
the turn's new tokens, and the next turn goes `think_s` after the previous
one finished. Single-request workloads are sessions of one turn.

Every trace comes from documented parameters and a seed, so every policy
replays exactly the same requests (the simulated engines' output is a
function of the prompt, so multi-turn contexts match too). The shapes:

  shared-prefix  SGLang bench_serving's "generated-shared-prefix" dataset at
                 its defaults (python/sglang/bench_serving.py: --gsp-num-groups
                 64, --gsp-prompts-per-group 16, --gsp-system-prompt-len 2048,
                 --gsp-question-len 128, --gsp-output-len 256), shuffled,
                 Poisson arrivals.
  multi-turn     vLLM's multi-turn generator defaults
                 (benchmarks/multi_turn/generate_multi_turn.json): a 500-token
                 prefix common to all conversations, a per-conversation prefix
                 of lognormal length (mean 1000, at most 5000), 12-18 turns
                 counting both roles (6-9 user turns), user turns of 120-160
                 tokens, answers of 80-120 tokens. Think time between turns is
                 not published: exponential, mean --think-s (ours). Poisson
                 session starts.
  mooncake       The Mooncake trace's published statistics (arXiv 2407.00079,
                 section 4: 23,608 requests in one hour = 6.56 req/s, average
                 input 7,590 tokens, average output 182, block reuse of about
                 50% with a large cache). Input and output lengths lognormal
                 with those means; each prompt starts with a prefix drawn from a
                 pool of shared documents by Zipf popularity, covering a
                 uniform 30-90% of its input, the rest unique. The published
                 hash_ids are not used (only the statistics above).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Dict, List

# Token ids are drawn from [1000, 100000): no special tokens.
_LO, _HI = 1000, 100000


@dataclass
class Turn:
    new_tokens: List[int]
    max_new_tokens: int
    think_s: float = 0.0  # wait after the previous turn finished


@dataclass
class Session:
    session_id: str
    start_s: float
    turns: List[Turn] = field(default_factory=list)


@dataclass
class Trace:
    name: str
    params: Dict
    source: str
    sessions: List[Session]

    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _tokens(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(_LO, _HI) for _ in range(n)]


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # mean of lognormal = exp(mu + sigma^2 / 2)
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def _poisson_starts(rng: random.Random, n: int, rate: float) -> List[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared_prefix(seed: int = 1, groups: int = 64, prompts_per_group: int = 16,
                  system_prompt_len: int = 2048, question_len: int = 128, output_len: int = 256,
                  rate: float = 12.0) -> Trace:
    rng = random.Random(seed)
    systems = [_tokens(rng, system_prompt_len) for _ in range(groups)]
    reqs = [(g, _tokens(rng, question_len)) for g in range(groups) for _ in range(prompts_per_group)]
    rng.shuffle(reqs)
    starts = _poisson_starts(rng, len(reqs), rate)
    sessions = [Session(f"gsp-{i}", starts[i], [Turn(systems[g] + q, output_len)])
                for i, (g, q) in enumerate(reqs)]
    return Trace("shared-prefix", dict(seed=seed, groups=groups, prompts_per_group=prompts_per_group,
                                       system_prompt_len=system_prompt_len, question_len=question_len,
                                       output_len=output_len, rate_per_s=rate),
                 "SGLang bench_serving generated-shared-prefix defaults", sessions)


def multi_turn(seed: int = 1, sessions: int = 96, common_prefix: int = 500,
               session_prefix_mean: int = 1000, session_prefix_max: int = 5000,
               user_turns: tuple = (6, 9), user_tokens: tuple = (120, 160),
               output_tokens: tuple = (80, 120), think_s: float = 2.0, rate: float = 1.6) -> Trace:
    rng = random.Random(seed)
    common = _tokens(rng, common_prefix)
    starts = _poisson_starts(rng, sessions, rate)
    out = []
    for i in range(sessions):
        plen = min(session_prefix_max, max(1, int(_lognormal(rng, session_prefix_mean, 0.5))))
        s = Session(f"chat-{i}", starts[i])
        for k in range(rng.randint(*user_turns)):
            new = _tokens(rng, rng.randint(*user_tokens))
            if k == 0:
                new = common + _tokens(rng, plen) + new
            s.turns.append(Turn(new, rng.randint(*output_tokens),
                                0.0 if k == 0 else rng.expovariate(1.0 / think_s)))
        out.append(s)
    return Trace("multi-turn", dict(seed=seed, sessions=sessions, common_prefix=common_prefix,
                                    session_prefix_mean=session_prefix_mean,
                                    session_prefix_max=session_prefix_max, user_turns=list(user_turns),
                                    user_tokens=list(user_tokens), output_tokens=list(output_tokens),
                                    think_s=think_s, session_rate_per_s=rate),
                 "vLLM benchmarks/multi_turn/generate_multi_turn.json defaults", out)


def mooncake(seed: int = 1, requests: int = 600, rate: float = 23608 / 3600.0,
             input_mean: int = 7590, output_mean: int = 182, documents: int = 256,
             zipf_s: float = 1.2, prefix_share: tuple = (0.3, 0.9), max_input: int = 32768) -> Trace:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(documents)]
    docs: Dict[int, List[int]] = {}
    starts = _poisson_starts(rng, requests, rate)
    out = []
    for i in range(requests):
        n_in = min(max_input, max(256, int(_lognormal(rng, input_mean, 0.8))))
        n_out = min(1024, max(16, int(_lognormal(rng, output_mean, 0.6))))
        d = rng.choices(range(documents), weights)[0]
        n_prefix = int(n_in * rng.uniform(*prefix_share))
        doc = docs.setdefault(d, [])
        if len(doc) < n_prefix:  # documents grow as longer prefixes of them are drawn
            doc.extend(_tokens(rng, n_prefix - len(doc)))
        prompt = doc[:n_prefix] + _tokens(rng, n_in - n_prefix)
        out.append(Session(f"mc-{i}", starts[i], [Turn(prompt, n_out)]))
    return Trace("mooncake", dict(seed=seed, requests=requests, rate_per_s=rate, input_mean=input_mean,
                                  output_mean=output_mean, documents=documents, zipf_s=zipf_s,
                                  prefix_share=list(prefix_share), max_input=max_input),
                 "Mooncake trace statistics, arXiv 2407.00079 section 4", out)


TRACES = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "mooncake": mooncake}

#!/usr/bin/env python3
"""A large trace shaped like a production conversation trace (Mooncake's format), for the
capacity planner: thousands of requests, long prompts, multi-turn sessions whose prompts
extend the previous turn's (shared ``hash_ids`` prefixes), arrivals in bursts.

The shape, each part seeded and stated:

- sessions start as a Poisson process whose rate swings by +-``--swing`` around the mean
  over a ``--period``-second cycle (busy and quiet spells); the times are scaled at the
  end so that requests come at ``--rate`` a second on average;
- a session has Geometric(``--turn-p``) turns (1 or more), ``--think-s`` (exponential mean)
  plus 30 ms an answer token apart;
- the first prompt is lognormal (median ``--prompt-median`` tokens, sigma ``--prompt-sigma``),
  each later turn adds the previous answer and a lognormal user message (median 400);
  prompts are capped at ``--max-prompt`` (a session that reaches it ends);
- answers are lognormal (median ``--output-median`` tokens, sigma 0.8, 1..4096);
- ``hash_ids`` are one id a 512-token block; a turn repeats its session's ids for the
  prefix it shares with the previous turn.

    python tools/make_trace.py --requests 5000 --rate 3.5 > /tmp/big.jsonl
    pdkv-transfer-test plan --trace /tmp/big.jsonl --bandwidth-gbps 25 --swap-gbps 50
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

BLOCK = 512  # tokens a hash id covers (Mooncake's)


def make(a: argparse.Namespace) -> list[dict[str, object]]:
    rng = np.random.default_rng(a.seed)
    out: list[tuple[float, int, int, list[int]]] = []
    next_id = 0
    t = 0.0
    while len(out) < a.requests:
        # thinning: the session rate at t is mean x (1 + swing x sin(2 pi t / period))
        peak = a.rate / a.turns_mean * (1 + a.swing)
        t += rng.exponential(1 / peak)
        now_rate = a.rate / a.turns_mean * (1 + a.swing * math.sin(2 * math.pi * t / a.period))
        if rng.random() > now_rate / peak:
            continue
        turns = int(rng.geometric(a.turn_p))  # 1, 2, ...: ends after each turn with turn_p
        prompt = int(np.clip(rng.lognormal(math.log(a.prompt_median), a.prompt_sigma), 64, a.max_prompt))
        ids: list[int] = []
        at = t
        for _ in range(turns):
            need = -(-prompt // BLOCK)
            while len(ids) < need:
                ids.append(next_id)
                next_id += 1
            answer = int(np.clip(rng.lognormal(math.log(a.output_median), 0.8), 1, 4096))
            out.append((at, prompt, answer, ids[:need]))
            # the next turn: this prompt, its answer and a new user message; the partial last
            # block of this prompt is recomputed, so ids are shared up to the whole blocks
            ids = ids[: prompt // BLOCK]
            prompt += answer + int(np.clip(rng.lognormal(math.log(400), 1.0), 8, 8192))
            if prompt > a.max_prompt:
                break
            at += rng.exponential(a.think_s) + answer * 0.03
    out.sort(key=lambda r: r[0])
    out = out[: a.requests]
    t0 = out[0][0]
    # sessions cut short by --max-prompt make fewer turns than 1 / turn_p: the times are
    # scaled so that the mean rate is --rate
    scale = (len(out) - 1) / a.rate / max(1e-9, out[-1][0] - t0)
    return [
        {
            "timestamp": int(round((ts - t0) * scale * 1000)),
            "input_length": n_in,
            "output_length": n_out,
            "hash_ids": ids,
        }
        for ts, n_in, n_out, ids in out
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=3.5, help="mean requests a second")
    ap.add_argument("--prompt-median", type=float, default=8000.0)
    ap.add_argument("--prompt-sigma", type=float, default=1.0)
    ap.add_argument("--max-prompt", type=int, default=126_000)
    ap.add_argument("--output-median", type=float, default=250.0)
    ap.add_argument("--turn-p", type=float, default=0.35, help="a session ends after each turn with this chance")
    ap.add_argument("--think-s", type=float, default=30.0)
    ap.add_argument("--swing", type=float, default=0.5, help="the session rate's swing around its mean, 0..1")
    ap.add_argument("--period", type=float, default=600.0, help="seconds of one busy-quiet cycle")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.requests <= 0 or a.rate <= 0 or not 0 <= a.swing < 1 or not 0 < a.turn_p <= 1:
        ap.error("--requests and --rate must be positive, --swing in [0, 1), --turn-p in (0, 1]")
    a.turns_mean = 1 / a.turn_p
    for rec in make(a):
        sys.stdout.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

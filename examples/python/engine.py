#!/usr/bin/env python3
"""A tiny inference engine in numpy that serves a multi-turn conversation through kvsnap.

The model is a hybrid of three layers — full attention (kvsnap.KVCache), a recurrent layer
(short causal conv + gated delta rule, kvsnap.RecurrentCache) and sliding-window attention
(kvsnap.RotatingKVCache) — written in numpy. It integrates kvsnap the way a Python engine
would:

- attention layers hand the keys and values they compute to `cache.update` (numpy arrays, taken
  without a copy) and attend over the history it returns (numpy views of the cache's buffers);
- the recurrent layer asks `snapshot_splits` where the prefix cache wants restore points inside
  this forward, runs its recurrence and hands one state per split point, then the end state, to
  `put` (adopted without a copy);
- each request goes through `PrefixCache.begin`: the model evaluates only `remaining()`, from
  offset `cached`.

Every logit the engine produces is checked against recomputing the whole conversation from
scratch with fresh caches.

    make python && PYTHONPATH=build/release/python /usr/bin/python3 examples/python/engine.py
"""
from __future__ import annotations

import dataclasses

import numpy as np

import kvsnap

VOCAB = 64
DIM = 32
HEADS, HEAD_DIM = 2, 8  # attention layers
WINDOW = 6  # sliding-window layer
CONV_TAIL = 3  # recurrent layer: conv of width 4 over q, k, v channels
V_HEADS, K_DIM, V_DIM = 2, 8, 8
CONV_DIM = V_HEADS * (2 * K_DIM + V_DIM)


def softmax(scores: np.ndarray) -> np.ndarray:
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


class Model:
    """Embedding, [attention, recurrent, window] with residuals, unembedding."""

    def __init__(self, seed: int = 7):
        rng = np.random.default_rng(seed)

        def weight(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.embed = weight(VOCAB, DIM) * np.float32(np.sqrt(VOCAB))
        self.unembed = weight(DIM, VOCAB)
        self.attention = {name: weight(DIM, HEADS * HEAD_DIM) for name in ("q", "k", "v")}
        self.attention["o"] = weight(HEADS * HEAD_DIM, DIM)
        self.window = {name: weight(DIM, HEADS * HEAD_DIM) for name in ("q", "k", "v")}
        self.window["o"] = weight(HEADS * HEAD_DIM, DIM)
        self.recurrent = {
            "in": weight(DIM, CONV_DIM),
            "conv": weight(CONV_DIM, CONV_TAIL + 1),
            "gate": weight(DIM, V_HEADS),
            "beta": weight(DIM, V_HEADS),
            "out": weight(V_HEADS * V_DIM, DIM),
        }

    @staticmethod
    def new_caches() -> list[kvsnap.Cache]:
        return [
            kvsnap.KVCache(),
            kvsnap.RecurrentCache(conv_tail=CONV_TAIL, conv_dim=CONV_DIM, num_v_heads=V_HEADS,
                                  head_v_dim=V_DIM, head_k_dim=K_DIM),
            kvsnap.RotatingKVCache(WINDOW),
        ]

    def forward(self, caches: list[kvsnap.Cache], tokens, offset: int) -> np.ndarray:
        """Logits [L, VOCAB] for `tokens` at positions offset, offset + 1, ..."""
        x = self.embed[np.asarray(tokens, dtype=np.int64)]
        x = x + attend(caches[0], self.attention, x, offset)
        x = x + recur(caches[1], self.recurrent, x, offset)
        x = x + attend(caches[2], self.window, x, offset)
        return x @ self.unembed


def attend(cache: kvsnap.Attention, w: dict, x: np.ndarray, offset: int) -> np.ndarray:
    """Causal attention over the cache's history (a sliding window when the cache has one)."""
    length = len(x)

    def heads(projection: np.ndarray) -> np.ndarray:  # [L, H*D] -> [1, H, L, D], a view
        return projection.reshape(length, HEADS, HEAD_DIM).transpose(1, 0, 2)[None]

    q, k, v = heads(x @ w["q"]), heads(x @ w["k"]), heads(x @ w["v"])
    history = cache.update(kvsnap.Batch.uniform(1, length, offset), k, v)
    keys, values = history.keys[0], history.values[0]  # [H, K, D]: views, no copy
    columns = np.arange(history.length)
    key_positions = history.first_position + (columns - history.oldest_column) % history.length
    query_positions = offset + np.arange(length)
    visible = key_positions[None, :] <= query_positions[:, None]
    if history.window:
        visible &= query_positions[:, None] - key_positions[None, :] < history.window
    scores = np.einsum("hld,hkd->hlk", q[0], keys) / np.float32(np.sqrt(HEAD_DIM))
    weights = softmax(np.where(visible, scores, -np.inf))
    out = np.einsum("hlk,hkd->lhd", weights, values).reshape(length, HEADS * HEAD_DIM)
    return out @ w["o"]


def recur(cache: kvsnap.RecurrentCache, w: dict, x: np.ndarray, offset: int) -> np.ndarray:
    """Causal conv then the gated delta rule, one token at a time, carrying kvsnap's state."""
    length = len(x)
    batch = kvsnap.Batch.uniform(1, length, offset)
    boundaries = cache.snapshot_splits(length) + [length]  # restore points, then the end
    state = cache.get(batch, "f32")
    inputs = np.concatenate([state.conv_state[0], x @ w["in"]])  # [CONV_TAIL + L, C]
    conv = sum(inputs[i:i + length] * w["conv"][:, i] for i in range(CONV_TAIL + 1))
    conv = conv * (1 / (1 + np.exp(-conv)))  # SiLU
    q, k, v = np.split(conv, [V_HEADS * K_DIM, 2 * V_HEADS * K_DIM], axis=1)
    q = q.reshape(length, V_HEADS, K_DIM)
    k = k.reshape(length, V_HEADS, K_DIM)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) + 1e-6
    k /= np.linalg.norm(k, axis=-1, keepdims=True) + 1e-6
    v = v.reshape(length, V_HEADS, V_DIM)
    decay = np.exp(-np.logaddexp(0, x @ w["gate"]))  # in (0, 1)
    beta = 1 / (1 + np.exp(-(x @ w["beta"])))
    memory = state.delta_state[0].copy()  # [Hv, Dv, Dk]; kvsnap's states are immutable values
    out = np.empty((length, V_HEADS, V_DIM), np.float32)
    delta_states = []
    for t in range(length):
        memory *= decay[t][:, None, None]
        recalled = np.einsum("hvk,hk->hv", memory, k[t])
        memory += beta[t][:, None, None] * np.einsum("hv,hk->hvk", v[t] - recalled, k[t])
        out[t] = np.einsum("hvk,hk->hv", memory, q[t])
        if t + 1 in boundaries:
            delta_states.append(memory[None].copy())
    conv_states = [inputs[t:t + CONV_TAIL][None] for t in boundaries]  # views of `inputs`
    cache.put(batch, conv_states, delta_states)  # adopted without a copy
    return out.reshape(length, V_HEADS * V_DIM) @ w["out"]


@dataclasses.dataclass
class Reply:
    tokens: list[int]
    logits: np.ndarray  # one row per generated token: the logits it was sampled from
    cached: int  # prompt tokens restored instead of evaluated


def serve(model: Model, prefix: kvsnap.PrefixCache, caches, prompt: list[int],
          message_ends: list[int], max_tokens: int) -> Reply:
    """One request: restore what the prefix cache holds, evaluate the rest, decode greedily."""
    with prefix.begin(prompt) as session:
        session.schedule_snapshots([end for end in message_ends if end > session.cached])
        logits = [model.forward(caches, session.remaining(), session.cached)[-1]]
        session.prefill_done()
        tokens = []
        for step in range(max_tokens):
            tokens.append(int(np.argmax(logits[-1])))
            session.append_output(tokens[-1])
            if step + 1 < max_tokens:  # a decoder does not feed its last token back
                logits.append(model.forward(caches, tokens[-1:], len(prompt) + step)[-1])
        return Reply(tokens, np.stack(logits), session.cached)


def recompute(model: Model, prompt: list[int], reply: Reply) -> np.ndarray:
    """The same logits from scratch: fresh caches, the whole sequence in one forward."""
    logits = model.forward(Model.new_caches(), prompt + reply.tokens[:-1], 0)
    return logits[len(prompt) - 1:]


def message(role: int, rng: np.random.Generator, length: int) -> list[int]:
    """A rendered message: a role token (1 system, 2 user, 3 assistant), content tokens, an end
    token (0). A prompt ends with 3, the start of the assistant's reply."""
    return [role] + [int(t) for t in rng.integers(4, VOCAB, length)] + [0]


def conversation(seed: int = 3):
    """(name, messages) per request: turns, a regeneration, an edit of the first question. None
    stands for the assistant's reply to the messages before it."""
    rng = np.random.default_rng(seed)
    system, first, second = message(1, rng, 20), message(2, rng, 9), message(2, rng, 7)
    edited, third = message(2, rng, 11), message(2, rng, 5)
    return [("turn 1", [system, first]), ("turn 2", [system, first, None, second]),
                    ("regenerate 2", [system, first, None, second]),
                    ("edit turn 1", [system, edited]),
                    ("turn 3", [system, first, None, second, None, third])]


def run(max_tokens: int = 6, verbose: bool = True) -> list[dict]:
    """Serves the conversation; returns one row per request (and raises if any logit differs)."""
    model = Model()
    caches = Model.new_caches()
    prefix = kvsnap.PrefixCache(caches)
    replies: dict[int, list[int]] = {}  # the reply to the first turns, by message count
    requests = conversation()
    rows = []
    for name, messages in requests:
        prompt, ends = [], []
        for index, content in enumerate(messages):
            prompt += content if content is not None else [3] + replies[index] + [0]
            ends.append(len(prompt))
        prompt.append(3)  # the assistant's turn: the reply follows
        reply = serve(model, prefix, caches, prompt, ends, max_tokens)
        replies.setdefault(len(messages), reply.tokens)
        expected = recompute(model, prompt, reply)
        error = float(np.max(np.abs(reply.logits - expected)))
        if error > 1e-4 or reply.tokens != [int(t) for t in np.argmax(expected, axis=1)]:
            raise AssertionError(f"{name}: kvsnap's logits differ from recomputation by {error}")
        rows.append({"request": name, "prompt": len(prompt), "cached": reply.cached,
                     "evaluated": len(prompt) - reply.cached, "max_error": error})
    assert prefix.check_invariants() == "", prefix.check_invariants()
    if verbose:
        print(f"{'request':<14}{'prompt':>8}{'cached':>8}{'evaluated':>11}{'max |error|':>14}")
        for row in rows:
            print(f"{row['request']:<14}{row['prompt']:>8}{row['cached']:>8}"
                  f"{row['evaluated']:>11}{row['max_error']:>14.1e}")
        print(f"prefix cache: {prefix.stats().reused_tokens} tokens reused, "
              f"{prefix.node_count} trie nodes; every logit equals recomputation")
    return rows


if __name__ == "__main__":
    run()

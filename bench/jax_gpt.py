#!/usr/bin/env python3
"""JAX (CPU) peer of `shardnet train gpt` in one process: the same GPT, data
and optimizer as bench/torch_gpt.py's --scheme single, written in plain
jax.numpy and jitted whole (forward, backward, clipping, AdamW in one XLA
program).

The model: byte tokens (V = 256), learned positions, L pre-LN blocks
(LayerNorm eps 1e-5, causal multi-head attention with the T x T scores,
GELU in GPT-2's tanh form, 4D hidden), ln_f and the LM head tied to the
token embedding; biases everywhere; no dropout. Initialisation N(0, 0.02),
residual projections 0.02/sqrt(2L), biases 0. AdamW (betas 0.9, 0.999, eps
1e-8, weight decay 0.01 on every tensor), gradients clipped to norm 1.
Windows of T + 1 tokens of fortunes' training records (every tenth held
out), shuffled by the seed.

XLA's CPU backend gets --threads threads (its Eigen pool). Timing:
--warmup steps (the first compiles), then --steps timed steps; prints one
JSON line: tokens_per_s, step_ms, peak_rss_mb, first_loss, last_loss.

    python3 bench/jax_gpt.py --threads 2 --layers 6 --dim 384 --heads 6 --seq 256
"""

import argparse
import json
import math
import os
import resource
import sys
import time


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    # The same flags, text and split as the PyTorch peer's.
    from torch_gpt import corpus, run_args

    p = argparse.ArgumentParser()
    run_args(p)
    a = p.parse_args()
    # Before jax is imported: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = (
        f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={a.threads}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    data = np.asarray(corpus(a.corpus).numpy(), dtype=np.int32)
    L, D, H, T, B, V = a.layers, a.dim, a.heads, a.seq, a.batch_size, 256
    hd = D // H

    def init(key):
        ks = iter(jax.random.split(key, 4 + 4 * L))
        n = lambda shape, std: std * jax.random.normal(next(ks), shape, jnp.float32)
        res = 0.02 / math.sqrt(2 * L)
        blocks = [{
            "ln_1": (jnp.ones(D), jnp.zeros(D)),
            "c_attn": (n((D, 3 * D), 0.02), jnp.zeros(3 * D)),
            "c_proj": (n((D, D), res), jnp.zeros(D)),
            "ln_2": (jnp.ones(D), jnp.zeros(D)),
            "c_fc": (n((D, 4 * D), 0.02), jnp.zeros(4 * D)),
            "mlp_proj": (n((4 * D, D), res), jnp.zeros(D)),
        } for _ in range(L)]
        return {"wte": n((V, D), 0.02), "wpe": n((T, D), 0.02), "h": blocks,
                "ln_f": (jnp.ones(D), jnp.zeros(D))}

    def ln(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * p[0] + p[1]

    def gelu(x):
        return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    mask = jnp.tril(jnp.ones((T, T), bool))

    def block(x, p):
        b, t, _ = x.shape
        qkv = ln(x, p["ln_1"]) @ p["c_attn"][0] + p["c_attn"][1]
        q, k, v = (z.reshape(b, t, H, hd).transpose(0, 2, 1, 3) for z in jnp.split(qkv, 3, -1))
        s = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
        s = jnp.where(mask[:t, :t], s, -jnp.inf)
        y = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, D)
        x = x + y @ p["c_proj"][0] + p["c_proj"][1]
        h = gelu(ln(x, p["ln_2"]) @ p["c_fc"][0] + p["c_fc"][1])
        return x + h @ p["mlp_proj"][0] + p["mlp_proj"][1]

    def loss_fn(params, x, y):
        h = params["wte"][x] + params["wpe"][: x.shape[1]]
        for p in params["h"]:
            h = block(h, p)
        logits = ln(h, params["ln_f"]) @ params["wte"].T
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, y[..., None], -1).mean()

    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01

    @jax.jit
    def step(params, m, v, t, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        norm = jnp.sqrt(sum(jnp.sum(z * z) for z in jax.tree_util.tree_leaves(g)))
        g = jax.tree_util.tree_map(lambda z: z * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), g)
        m = jax.tree_util.tree_map(lambda mm, gg: b1 * mm + (1 - b1) * gg, m, g)
        v = jax.tree_util.tree_map(lambda vv, gg: b2 * vv + (1 - b2) * gg * gg, v, g)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        params = jax.tree_util.tree_map(
            lambda w, mm, vv: w * (1 - a.lr * wd) - a.lr * (mm / c1) / (jnp.sqrt(vv / c2) + eps),
            params, m, v)
        return params, m, v, loss

    params = init(jax.random.PRNGKey(a.seed))
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    windows = (len(data) - 1) // T
    order = np.random.default_rng(a.seed).permutation(windows)
    losses = []

    def batch(i):
        at = (i * B) % max(1, windows - B)
        starts = order[at: at + B] * T
        x = np.stack([data[s: s + T] for s in starts])
        y = np.stack([data[s + 1: s + T + 1] for s in starts])
        return jnp.asarray(x), jnp.asarray(y)

    for i in range(a.warmup):
        params, m, v, loss = step(params, m, v, float(i + 1), *batch(i))
        losses.append(float(loss))
    t0 = time.perf_counter()
    for i in range(a.steps):
        k = a.warmup + i
        params, m, v, loss = step(params, m, v, float(k + 1), *batch(k))
        losses.append(float(loss))  # waits for the step
    dt = time.perf_counter() - t0
    print(json.dumps({
        "scheme": "jax-single", "threads": a.threads,
        "tokens_per_s": a.steps * B * T / dt, "step_ms": 1e3 * dt / a.steps,
        "peak_rss_mb": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024],
        "first_loss": losses[0], "last_loss": losses[-1],
    }))


if __name__ == "__main__":
    main()

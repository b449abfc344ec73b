import numpy as np
import kvsnap

cache = kvsnap.KVCache()
keys = np.random.rand(1, 8, 12, 64).astype(np.float16)  # [B, H, L, D]: taken without a copy
history = cache.update(kvsnap.Batch.uniform(1, 12, 0), keys, keys)
assert np.shares_memory(history.keys, cache.state()[0])  # a read-only view of the cache

snapshot = cache.snapshot(0)        # lazy [0, 12): no copy
cache.restore(None, 5)              # rewind (rejected draft tokens)
assert cache.restore(snapshot, 12)  # and back

try:
    cache.prepare_snapshots([4, 9])
except kvsnap.Error as error:       # kvsnap's message: the call, the values, the rule
    print(error)

layer = kvsnap.KVCache()
prefix = kvsnap.PrefixCache([layer, None])  # one cache per layer, None for a stateless one
for prompt in ([1, 2, 3, 4, 5], [1, 2, 3, 9]):
    with prefix.begin(prompt) as session:  # closing pages the evaluated tokens out
        todo = session.remaining()         # evaluate these from offset session.cached
        batch = kvsnap.Batch.single(todo, session.cached)
        layer.update(batch, keys[:, :, :len(todo)], keys[:, :, :len(todo)])
        session.prefill_done()
print(prefix.stats().reused_tokens, "tokens reused")  # 3

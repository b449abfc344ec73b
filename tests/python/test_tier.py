"""The shared tier from Python: two prefix caches (two processes' worth of state) over one store
— a private folder, and a real redis-server started on a free loopback port — where the second
restores what the first evaluated instead of recomputing it; keys, bad options and logs."""
import os
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

import kvsnap

PROMPT = list(range(100, 120))  # 20 tokens: five chunks of 4


def token_kv(tokens):
    """Keys or values [1, 2, len(tokens), 4] of `tokens`, element 0 of each head the token id."""
    out = np.zeros((1, 2, len(tokens), 4), np.float32)
    for t, token in enumerate(tokens):
        out[0, :, t, 0] = token
        out[0, :, t, 1:] = np.sin(token * np.arange(1, 4))
    return out


class Process:
    """One process's layers, prefix cache and tier."""

    def __init__(self, address, **options):
        options.setdefault("model_fingerprint", "test model")
        options.setdefault("chunk_tokens", 4)
        options.setdefault("log_to_stderr", False)
        options.setdefault("lookup_timeout", 5.0)
        self.cache = kvsnap.KVCache()
        self.layers = [self.cache, None]
        self.tier = kvsnap.Tier(address, self.layers, **options)
        self.prefix = kvsnap.PrefixCache(self.layers, tier=self.tier)

    def serve(self, prompt):
        """Runs `prompt` through a session (its KV the tokens' own); returns the tokens restored."""
        with self.prefix.begin(prompt) as session:
            cached, remaining = session.cached, list(session.remaining())
            self.cache.update(kvsnap.Batch.single(remaining, cached), token_kv(remaining),
                              token_kv(remaining))
            session.prefill_done()
        assert self.tier.flush()
        return cached

    def held(self):
        """The token ids the cache holds, in order."""
        return [int(v) for v in self.cache.view(kvsnap.Batch.uniform(1, 1, 0)).values[0, 0, :, 0]]


def both_ways(address):
    first = Process(address)
    assert first.serve(PROMPT) == 0
    assert first.tier.stats().objects_written > 0
    second = Process(address)  # another process: nothing in its trie
    cached = second.serve(PROMPT + [7, 8])
    assert cached >= 16  # from the tier: what the first evaluated, to a chunk's restore point
    assert second.held() == PROMPT + [7, 8]  # what the tier restored, then the new tokens
    stats = second.tier.stats()
    assert stats.hits == 1 and stats.restored_tokens == cached and stats.bytes_read > 0
    assert stats.rejected == 0 and stats.store_errors == 0
    return first, second


def test_a_second_process_restores_through_a_folder(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    first, _ = both_ways(f"dir:{folder}")
    assert first.tier.address == f"dir:{folder}"
    assert not first.tier.authenticated
    assert any("trusted" in line for line in first.tier.take_log())  # said once, kept for us
    assert first.tier.take_log() == []


@pytest.fixture
def redis_address():
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            assert process.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer in 10 s"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_second_process_restores_through_redis(redis_address):
    both_ways(redis_address)


def test_damaged_objects_are_rejected_and_another_keys_are_never_found(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    key_file = tmp_path / "tier.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    key_file.chmod(0o600)
    key = kvsnap.load_tier_key(str(key_file))
    assert key == b"0123456789abcdef0123456789abcdef"  # trailing whitespace dropped
    writer = Process(f"dir:{folder}", key=key)
    assert writer.tier.authenticated
    writer.serve(PROMPT)
    other = Process(f"dir:{folder}", key=b"another key of sixteen bytes or more")
    assert other.serve(PROMPT + [7]) == 0  # names of another key: another namespace
    assert other.tier.stats().hits == 0
    objects = [path for path in folder.iterdir() if path.is_file()]
    assert objects
    for path in objects:  # one byte of each object flipped
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    reader = Process(f"dir:{folder}", key=key)
    assert reader.serve(PROMPT + [7]) == 0
    assert reader.held() == PROMPT + [7]  # recomputed, nothing damaged restored
    assert reader.tier.stats().rejected > 0
    assert any(line.startswith("rejected ") for line in reader.tier.take_log())
    key_file.chmod(0o644)
    with pytest.raises(kvsnap.Error, match="tier.key"):
        kvsnap.load_tier_key(str(key_file))


def test_bad_options_raise_kvsnap_error_naming_the_rule(tmp_path):
    cache = kvsnap.KVCache()
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    with pytest.raises(kvsnap.Error, match="model fingerprint is empty"):
        kvsnap.Tier(f"dir:{folder}", [cache], model_fingerprint="")
    with pytest.raises(kvsnap.Error, match=r"^Tier: lookup_timeout -1 s is not a number"):
        kvsnap.Tier(f"dir:{folder}", [cache], model_fingerprint="m", lookup_timeout=-1)
    with pytest.raises(kvsnap.Error, match="redis://"):
        kvsnap.Tier("http://example", [cache], model_fingerprint="m")
    with pytest.raises(kvsnap.Error, match="max_lookup_bytes 0"):
        kvsnap.Tier(f"dir:{folder}", [cache], model_fingerprint="m", max_lookup_bytes=0)
    # An empty key (an unset variable's) is refused: only None opens a trusted store.
    with pytest.raises(kvsnap.Error, match="key is empty"):
        kvsnap.Tier(f"dir:{folder}", [cache], model_fingerprint="m", key=b"")
    tier = kvsnap.Tier(f"dir:{folder}", [cache], model_fingerprint="m", log_to_stderr=False)
    with pytest.raises(kvsnap.Error, match="other layers"):
        kvsnap.PrefixCache([kvsnap.KVCache()], tier=tier)
    with pytest.raises(kvsnap.Error, match="tier must be a kvsnap.Tier"):
        kvsnap.PrefixCache([cache], tier="dir:/tmp")


def test_the_password_of_an_address_file_never_shows(tmp_path):
    address_file = tmp_path / "tier.address"
    address_file.write_text("redis://:s3cret@127.0.0.1:1/0\n")
    address_file.chmod(0o600)
    address = kvsnap.load_tier_address(str(address_file))
    assert address == "redis://:s3cret@127.0.0.1:1/0"
    unreachable = Process(address)  # port 1: refused
    assert unreachable.tier.address == "redis://:***@127.0.0.1:1/0"
    assert unreachable.serve(PROMPT) == 0  # a store that fails costs restores, not the request
    lines = unreachable.tier.take_log()
    assert lines and not [line for line in lines if "s3cret" in line], lines
    assert unreachable.tier.stats().store_errors > 0

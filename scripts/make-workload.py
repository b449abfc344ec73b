#!/usr/bin/env python3
"""Writes data/workload.jsonl, the embedded default workload of `kvsnap replay`.

Deterministic: chat conversations on a shared system prompt (multi-turn continuations,
regenerations, edits of an earlier turn) and an agent loop with long tool outputs.
"""
import json
import random
import sys

random.seed(7)
SYSTEM = ("You are Kestrel, the assistant of the Harbor platform team. Answer concisely, cite the "
          "runbook section you rely on, and never print secrets. The team runs three clusters "
          "(dev, staging, prod) on Kubernetes 1.29 with Postgres 15, Redis 7 and an internal "
          "artifact registry. Escalate to the on-call engineer for anything that touches prod data.")
AGENT = ("You are Kestrel-Agent. You fix failing builds by calling tools. Available tools: "
         "run(cmd) returns stdout and stderr; read(path) returns a file; write(path, text) replaces "
         "a file. Think step by step, call one tool per turn, and stop when the tests pass.")

lines = []

def add(**fields):
    lines.append(json.dumps(fields, ensure_ascii=True))

def user(text):
    return {"role": "user", "content": text}

def tool(text):
    return {"role": "tool", "content": text}

def log_block(kind, n):
    rows = []
    for i in range(n):
        if kind == "ls":
            rows.append(f"-rw-r--r-- 1 ci ci {random.randint(200, 90000):6d} Nov {random.randint(1, 28):2d} "
                        f"src/{random.choice(['cache', 'trie', 'model', 'ops', 'io'])}/"
                        f"{random.choice(['kv', 'window', 'state', 'page', 'node'])}_{i}.cc")
        elif kind == "test":
            ok = random.random() > 0.12
            rows.append(f"[{'       OK' if ok else '  FAILED '}] {random.choice(['Cache', 'Trie', 'Model'])}"
                        f"Test.Case{i} ({random.randint(0, 40)} ms)")
        else:
            rows.append(f"2026-11-30T12:{i % 60:02d}:{random.randint(0, 59):02d}Z worker-{random.randint(1, 4)} "
                        f"{random.choice(['INFO', 'INFO', 'WARN', 'ERROR'])} "
                        f"{random.choice(['compacting segment', 'retrying upload', 'cache miss on layer', 'lease renewed'])} "
                        f"id={random.randint(1000, 9999)}")
    return "\n".join(rows)

# Conversation 1: multi-turn, then a regeneration of turn 2 and a continuation of it.
add(id="c1", messages=[{"role": "system", "content": SYSTEM},
                       user("How do I rotate the API keys for the staging cluster?")], max_tokens=16)
add(id="c1-2", after="c1", messages=[user("Do the old keys keep working during the rollout?")], max_tokens=16)
add(id="c1-3", after="c1-2", messages=[user("Write the kubectl commands for step 2.")], max_tokens=20)
add(id="c1-2r", regenerate="c1-2", max_tokens=16)
add(id="c1-3b", after="c1-2r", messages=[user("And how do I verify the new keys are live?")], max_tokens=16)

# Conversation 2: the same system prompt; an edit of its second turn.
add(id="c2", messages=[{"role": "system", "content": SYSTEM},
                       user("Redis latency on prod doubled since this morning. Where do I start?")], max_tokens=16)
add(id="c2-2", after="c2", messages=[user("SLOWLOG shows KEYS * calls every few seconds.")], max_tokens=16)
add(id="c2-3", after="c2-2", messages=[user("Which service is likely issuing them?")], max_tokens=16)
add(id="c2-2e", edit="c2-2", messages=[user("INFO shows evicted_keys climbing and maxmemory at 95%.")], max_tokens=16)
add(id="c2-3e", after="c2-2e", messages=[user("Should I raise maxmemory or change the policy?")], max_tokens=16)

# Conversation 3: a regeneration of the first answer, then more turns.
add(id="c3", messages=[{"role": "system", "content": SYSTEM},
                       user("Summarize the deploy freeze policy for the holidays.")], max_tokens=16)
add(id="c3r", regenerate="c3", max_tokens=16)
add(id="c3-2", after="c3r", messages=[user("Who can approve an exception?")], max_tokens=16)
add(id="c3-3", after="c3-2", messages=[user("Draft the exception request for the registry upgrade.")], max_tokens=24)

# Conversation 4: imported history with an earlier assistant turn, continued twice.
add(id="c4", messages=[{"role": "system", "content": SYSTEM},
                       user("Our nightly Postgres backup job failed."),
                       {"role": "assistant", "content": "Check the job logs in the ops namespace and the free space on the backup volume."},
                       user("The volume is at 99%. Logs below.\n" + log_block("log", 12))], max_tokens=16)
add(id="c4-2", after="c4", messages=[user("Can I delete backups older than 30 days safely?")], max_tokens=16)
add(id="c4-3", after="c4-2", messages=[user("Write the retention policy as a CronJob.")], max_tokens=24)

# An agent loop with long tool outputs; a regenerated step and an edited tool result.
add(id="a1", messages=[{"role": "system", "content": AGENT},
                       user("The CI build of harbor-cache is red on main. Make it green.")], max_tokens=16)
add(id="a2", after="a1", messages=[tool("$ ls -l src\n" + log_block("ls", 24))], max_tokens=16)
add(id="a3", after="a2", messages=[tool("$ ctest --output-on-failure\n" + log_block("test", 30))], max_tokens=16)
add(id="a4", after="a3", messages=[tool("$ cat logs/worker.log\n" + log_block("log", 28))], max_tokens=16)
add(id="a4r", regenerate="a4", max_tokens=16)
add(id="a5", after="a4r", messages=[tool("$ git diff HEAD~1 --stat\n" + log_block("ls", 16))], max_tokens=16)
add(id="a6", after="a5", messages=[tool("$ ctest --output-on-failure\n" + log_block("test", 30))], max_tokens=16)
add(id="a6e", edit="a6", messages=[tool("$ ctest -R Trie --output-on-failure\n" + log_block("test", 12))], max_tokens=16)
add(id="a7", after="a6e", messages=[tool("$ cat logs/worker.log | tail -n 20\n" + log_block("log", 20))], max_tokens=16)
add(id="a8", after="a7", messages=[tool("$ ctest\n" + log_block("test", 20) + "\n100% tests passed")], max_tokens=16)

# Back to conversation 1 after everything else, and a new conversation on the system prompt.
add(id="c1-4", after="c1-3", messages=[user("Thanks. Now the same for prod, with the approval steps.")], max_tokens=24)
add(id="c5", messages=[{"role": "system", "content": SYSTEM},
                       user("What is the on-call rotation this week?")], max_tokens=16)
add(id="c5-2", after="c5", messages=[user("Page them about the registry disk alert.")], max_tokens=16)

out = sys.argv[1] if len(sys.argv) > 1 else "data/workload.jsonl"
with open(out, "w") as f:
    f.write("# kvsnap replay default workload (generated by scripts/make-workload.py)\n")
    f.write("\n".join(lines) + "\n")
print(f"wrote {len(lines)} requests to {out}")
